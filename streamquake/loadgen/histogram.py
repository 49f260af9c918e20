"""Sparse HDR histograms: hdrh's bucket layout and wire format, without its dense array.

An ``hdrh.HdrHistogram`` at 4 significant digits over an hour in microseconds holds a 311,296
counter array (1.2 MB at 4 bytes a counter) however few values it saw, and a run keeps one
per phase, class and metric in every load process and again in the runner. Here a histogram
is a dict from hdrh's counts index to its count: the same buckets (so the same values, to
the same precision, as hdrh would report), sized by the buckets actually used. One shared
``HdrHistogram`` per precision does the index arithmetic, and encodes and decodes the
standard V2 histoblob (base64, zlib) that crosses processes and hosts: any HdrHistogram
implementation can read what a worker sends.

Values are recorded as integers (the caller scales milliseconds to microseconds); merging is
adding counts index by index, so merged percentiles equal those of the union exactly.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable
from functools import cache

from hdrh.histogram import HdrHistogram

from streamquake.loadgen import speedups
from streamquake.stats import nearest_rank

HIGHEST = 3_600_000_000          # one hour in microseconds; 1e6 tokens/s in milli-tokens/s
# HdrHistogram's V2 wire format: cookies (the low nibble's word-size bits masked off) and the
# big-endian payload header: cookie, varint length, normalizing index offset, significant
# digits, lowest and highest trackable values, integer-to-double ratio; then ZigZag LEB128
# counts, a negative one standing for that many empty buckets.
_ENCODING_COOKIE = 0x1C849303
_COMPRESSION_COOKIE = 0x1C849304
_PAYLOAD_HEADER = ">IIIIqqd"
_SPARSE_ENCODE_MAX = 512          # buckets up to which encode() writes the blob itself


if array("I").itemsize != 4:     # pragma: no cover - every platform CPython supports today
    raise ImportError("streamquake needs a 4-byte array('I')")


@cache
def _layout(sig_figs: int) -> HdrHistogram:
    """The shared, never-recorded-into histogram whose bucket arithmetic this precision uses."""
    return HdrHistogram(1, HIGHEST, sig_figs, word_size=4)


@cache
def _index_constants(sig_figs: int) -> tuple[int, int, int, int]:
    """(sub-bucket mask, unit magnitude, half-count magnitude + 1, half count) of the layout:
    hdrh's counts-index arithmetic, precomputed, for the recording hot path."""
    h = _layout(sig_figs)
    return (h.sub_bucket_mask, h.unit_magnitude, h.sub_bucket_half_count_magnitude,
            h.sub_bucket_half_count)


def bucket_index(value: int, sig_figs: int) -> int:
    """The counts index of the bucket that holds ``value`` (clamped to 0..HIGHEST) at this
    precision: what :meth:`SparseHistogram.record` computes inline."""
    value = HIGHEST if value > HIGHEST else (value if value > 0 else 0)
    mask, unit, half_magnitude, half = _index_constants(sig_figs)
    bucket = (value | mask).bit_length() - unit - half_magnitude - 1
    return ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half


def count_ms(counts: dict[int, int], values_ms: Iterable[float], sig_figs: int, base: int = 0
             ) -> None:
    """Count milliseconds as microseconds in ``counts``, each at ``base`` + its bucket's index:
    :meth:`SparseHistogram.record_ms` for a table that is not a histogram's own."""
    _count(counts, values_ms, *_index_constants(sig_figs), base)


def _count(counts: dict[int, int], values_ms: Iterable[float], mask: int, unit: int,
           half_magnitude: int, half: int, base: int) -> int:
    """The loop of :func:`count_ms` and :meth:`SparseHistogram.record_ms`: compiled where the
    compiled part is built; the number of values counted."""
    count = _count_ms_py if _count_ms is None else _count_ms
    return count(counts, values_ms, mask, unit, half_magnitude, half, base)


def _count_ms_py(counts: dict[int, int], values_ms: Iterable[float], mask: int, unit: int,
                 half_magnitude: int, half: int, base: int) -> int:
    """:func:`count_ms`'s loop in Python: what ``_speedups.count_ms`` does compiled (equal
    answers: tests/test_speedups.py); the number of values counted."""
    n = 0
    for ms in values_ms:
        value = round(ms * 1000.0)
        value = HIGHEST if value > HIGHEST else (value if value > 0 else 0)
        bucket = (value | mask).bit_length() - unit - half_magnitude - 1
        key = base + ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half
        counts[key] = counts.get(key, 0) + 1
        n += 1
    return n


_count_ms = speedups.count_ms


def _varints_py(counts: dict[int, int]) -> bytes:
    """A V2 payload's counts for a histogram's {index: count}, in index order: what
    ``_speedups.varints`` writes compiled (equal bytes: tests/test_speedups.py)."""
    out = bytearray()
    append = out.append
    prev = -1
    for index, count in sorted(counts.items()):
        gap = index - prev - 1
        if gap:
            v = (gap << 1) - 1          # ZigZag of -gap
            while v > 0x7F:
                append((v & 0x7F) | 0x80)
                v >>= 7
            append(v)
        v = count << 1
        while v > 0x7F:
            append((v & 0x7F) | 0x80)
            v >>= 7
        append(v)
        prev = index
    return bytes(out)


_varints = speedups.varints


class SparseHistogram:
    __slots__ = ("sig_figs", "counts", "total", "_layout", "_sorted", "_index", "_blob")

    def __init__(self, sig_figs: int = 4) -> None:
        self.sig_figs = sig_figs
        self.counts: dict[int, int] = {}
        self.total = 0
        self._layout = _layout(sig_figs)
        self._index = _index_constants(sig_figs)
        self._sorted: list[tuple[int, int]] | None = None
        self._blob: str | None = None       # encode()'s last answer, until the next change

    def record(self, value: int, count: int = 1) -> None:
        """Record ``value`` (clamped to 0..HIGHEST) ``count`` times."""
        value = HIGHEST if value > HIGHEST else (value if value > 0 else 0)
        mask, unit, half_magnitude, half = self._index
        # hdrh's _counts_index_for, inlined: the bucket is the smallest power of two holding
        # the value; the index is the bucket's base plus the value's sub-bucket within it.
        bucket = (value | mask).bit_length() - unit - half_magnitude - 1
        index = ((bucket + 1) << half_magnitude) + (value >> (bucket + unit)) - half
        counts = self.counts
        counts[index] = counts.get(index, 0) + count
        self.total += count
        self._sorted = self._blob = None

    def record_ms(self, values: Iterable[float]) -> None:
        """Record milliseconds as microseconds, one each (the gaps of a stream)."""
        self.total += _count(self.counts, values, *self._index, 0)
        self._sorted = self._blob = None

    def merge(self, other: SparseHistogram) -> None:
        if other.sig_figs != self.sig_figs:
            raise ValueError(f"cannot merge a {other.sig_figs}-digit histogram into a "
                             f"{self.sig_figs}-digit one")
        counts = self.counts
        for index, n in other.counts.items():
            counts[index] = counts.get(index, 0) + n
        self.total += other.total
        self._sorted = self._blob = None

    def buckets(self) -> list[tuple[int, int]]:
        """(counts index, count) of every recorded bucket, in value order."""
        if self._sorted is None:
            self._sorted = sorted(self.counts.items())
        return self._sorted

    def value_at(self, index: int) -> int:
        """The highest value that lands in bucket ``index`` (what hdrh reports for it)."""
        layout = self._layout
        return int(layout.get_highest_equivalent_value(layout.get_value_from_index(index)))

    def percentile(self, p: float) -> int | None:
        """Nearest rank, ceil(p/100 * n): the smallest bucket with at least p% of the values
        at or below it (hdrh's own rounds the rank to the nearest instead)."""
        if not self.total:
            return None
        target = nearest_rank(p, self.total)
        seen = 0
        for index, count in self.buckets():
            seen += count
            if seen >= target:
                return self.value_at(index)
        raise AssertionError("bucket counts add up to less than the histogram's total")

    def at_rank(self, rank: int) -> int | None:
        """The value of the ``rank``-th smallest recorded value (1-based); None past the end."""
        if rank < 1 or rank > self.total:
            return None
        seen = 0
        for index, count in self.buckets():
            seen += count
            if seen >= rank:
                return self.value_at(index)
        raise AssertionError("bucket counts add up to less than the histogram's total")

    def copy(self) -> SparseHistogram:
        out = SparseHistogram(self.sig_figs)
        out.counts = dict(self.counts)
        out.total = self.total
        return out

    def mean(self) -> float | None:
        if not self.total:
            return None
        layout = self._layout
        acc = 0
        for index, count in self.buckets():
            low = layout.get_value_from_index(index)
            acc += count * (low + layout.get_highest_equivalent_value(low) + 1) // 2
        return acc / self.total

    def max(self) -> int | None:
        return self.value_at(self.buckets()[-1][0]) if self.total else None

    def encode(self) -> str:
        """The standard HdrHistogram V2 histoblob (base64 of the zlib-compressed counts); kept
        until the histogram changes, so a checkpoint re-encodes only what changed."""
        if self._blob is None:
            self._blob = self._encode()
        return self._blob

    def _encode(self) -> str:
        # Compiled, the sparse writer is the cheaper at any size (a checkpoint of 100 classes
        # at 500 streams spent most of its time in hdrh's dense encoder).
        if _varints is not None or len(self.counts) <= _SPARSE_ENCODE_MAX:
            return self._encode_sparse()
        return self._encode_dense()

    def _encode_sparse(self) -> str:
        """The same V2 histoblob written from the buckets used, with no dense counts array:
        ZigZag LEB128 counts, each run of empty buckets as one negative number (as hdrh does),
        in a zlib stream of stored blocks (any inflater reads it). For a few hundred buckets
        this is 3-100x cheaper than hdrh's encoder, whose cost follows the largest value's
        index."""
        out = _varints_py(self.counts) if _varints is None else _varints(self.counts)
        payload = struct.pack(_PAYLOAD_HEADER, _ENCODING_COOKIE | 0x10, len(out), 0,
                              self.sig_figs, 1, HIGHEST, 1.0) + out
        # Stored, not compressed: the varints are compact already (deflate took a third off
        # an ITL histogram's 1 KB), and deflating one took 30-180 us in a load process (its
        # Huffman blocks; zlib's default buffers, 256 KiB of fresh pages each time), stored
        # 1-2 us; a checkpoint of 100 classes encodes a hundred every 2 s. The small window
        # and memory level keep the stream's own setup small.
        deflate = zlib.compressobj(0, zlib.DEFLATED, 9, 1)
        packed = deflate.compress(payload) + deflate.flush()
        return base64.b64encode(struct.pack(">II", _COMPRESSION_COOKIE | 0x10, len(packed))
                                + packed).decode("ascii")

    def _encode_dense(self) -> str:
        layout = self._layout
        for index, n in self.counts.items():
            layout.counts[index] = n
        layout.total_count = self.total
        # The encoder compresses the counts up to the bucket of max_value.
        layout.max_value = layout.get_value_from_index(max(self.counts, default=0))
        try:
            return bytes(layout.encode()).decode("ascii")
        finally:
            for index in self.counts:
                layout.counts[index] = 0
            layout.total_count = layout.max_value = 0

    @classmethod
    def decode(cls, blob: str, sig_figs: int = 4) -> SparseHistogram:
        """Read a histoblob (from :meth:`encode`, or any V2 HdrHistogram with this layout),
        straight from its varint stream to buckets: no dense counts array is built."""
        try:
            raw = base64.b64decode(blob, validate=True)
            cookie, length = struct.unpack_from(">II", raw)
            if cookie & ~0xF0 != _COMPRESSION_COOKIE or length != len(raw) - 8:
                raise ValueError("not a compressed V2 histoblob")
            payload = zlib.decompress(raw[8:])
            (cookie, varint_len, offset, digits, lowest, highest,
             _ratio) = struct.unpack_from(_PAYLOAD_HEADER, payload)
        except (struct.error, zlib.error, binascii.Error) as exc:
            raise ValueError(f"not a histoblob: {exc}") from None
        if cookie & ~0xF0 != _ENCODING_COOKIE or offset != 0:
            raise ValueError("not a V2 histogram payload")
        if (digits, lowest, highest) != (sig_figs, 1, HIGHEST):
            raise ValueError(f"histogram layout {digits} digits over {lowest}..{highest}, "
                             f"expected {sig_figs} over 1..{HIGHEST}")
        out = cls(sig_figs)
        counts = out.counts
        limit = _layout(sig_figs).counts_len
        index = acc = shift = 0
        start = struct.calcsize(_PAYLOAD_HEADER)
        for byte in payload[start:start + varint_len]:
            if shift == 56:                 # the 9th byte of a 64-bit LEB128 holds 8 bits
                acc |= byte << 56
            else:
                acc |= (byte & 0x7F) << shift
                if byte & 0x80:
                    shift += 7
                    continue
            value = (acc >> 1) ^ -(acc & 1)     # ZigZag
            acc = shift = 0
            if value < 0:
                index -= value                  # a run of empty buckets
                continue
            if value:
                if index >= limit:
                    raise ValueError("histoblob counts run past the layout")
                counts[index] = value
            index += 1
        out.total = sum(counts.values())
        return out

    def pack(self) -> str:
        """The buckets as base64 of little-endian uint32 pairs (index, count): the compact form
        the timeline's seconds use (a few hundred buckets; read back with no decoding loop)."""
        return pack_pairs(self.counts)

    @classmethod
    def unpack(cls, packed: str, sig_figs: int) -> SparseHistogram:
        flat = unpack_pairs(packed, "buckets")
        out = cls(sig_figs)
        indices, counts = flat[::2], flat[1::2]
        if indices and max(indices) >= _layout(sig_figs).counts_len:
            raise ValueError("packed buckets run past the layout")
        out.counts = dict(zip(indices, counts, strict=True))
        out.total = sum(counts)
        return out


def pack_pairs(table: dict[int, int]) -> str:
    """A {key: count} table's pairs in key order, as base64 of little-endian uint32s (key,
    count); compiled where the compiled part is built (``_speedups.pairs_le32``)."""
    raw = _pairs_le32_py(table) if _pairs_le32 is None else _pairs_le32(table)
    return base64.b64encode(raw).decode("ascii")


def _pairs_le32_py(table: dict[int, int]) -> bytes:
    """:func:`pack_pairs`'s bytes in Python (equal to the compiled ones: tests/test_speedups.py)."""
    flat = array("I", [x for pair in sorted(table.items()) for x in pair])
    if sys.byteorder == "big":
        flat.byteswap()
    return flat.tobytes()


_pairs_le32 = speedups.pairs_le32


def unpack_pairs(packed: str, what: str) -> array[int]:
    """What :func:`pack_pairs` wrote, flat (key, count, key, count...); ValueError, naming
    ``what``, for anything else."""
    flat = array("I")
    try:
        flat.frombytes(base64.b64decode(packed, validate=True))
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"not packed {what}: {exc}") from None
    if sys.byteorder == "big":
        flat.byteswap()
    if len(flat) % 2:
        raise ValueError(f"packed {what}: a key without its count")
    return flat
