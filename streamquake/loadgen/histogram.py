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

import itertools
import math
from functools import cache

from hdrh.histogram import HdrHistogram

HIGHEST = 3_600_000_000          # one hour in microseconds; 1e6 tokens/s in milli-tokens/s


@cache
def _layout(sig_figs: int) -> HdrHistogram:
    """The shared, never-recorded-into histogram whose bucket arithmetic this precision uses."""
    return HdrHistogram(1, HIGHEST, sig_figs, word_size=4)


class SparseHistogram:
    __slots__ = ("sig_figs", "counts", "total", "_layout", "_sorted")

    def __init__(self, sig_figs: int = 4) -> None:
        self.sig_figs = sig_figs
        self.counts: dict[int, int] = {}
        self.total = 0
        self._layout = _layout(sig_figs)
        self._sorted: list[tuple[int, int]] | None = None

    def record(self, value: int, count: int = 1) -> None:
        """Record ``value`` (clamped to 0..HIGHEST) ``count`` times."""
        value = min(HIGHEST, max(0, value))
        index = self._layout._counts_index_for(value)
        counts = self.counts
        counts[index] = counts.get(index, 0) + count
        self.total += count
        self._sorted = None

    def merge(self, other: SparseHistogram) -> None:
        if other.sig_figs != self.sig_figs:
            raise ValueError(f"cannot merge a {other.sig_figs}-digit histogram into a "
                             f"{self.sig_figs}-digit one")
        counts = self.counts
        for index, n in other.counts.items():
            counts[index] = counts.get(index, 0) + n
        self.total += other.total
        self._sorted = None

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
        target = max(1, math.ceil(p * self.total / 100.0 - 1e-9))
        seen = 0
        for index, count in self.buckets():
            seen += count
            if seen >= target:
                return self.value_at(index)
        raise AssertionError("bucket counts add up to less than the histogram's total")

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
        """The standard HdrHistogram V2 histoblob (base64 of the zlib-compressed counts)."""
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
        """Read a histoblob (from :meth:`encode`, or any HdrHistogram with this layout)."""
        dense = HdrHistogram.decode(blob.encode("ascii"))
        out = cls(sig_figs)
        if (dense.significant_figures, dense.highest_trackable_value) != (sig_figs, HIGHEST):
            raise ValueError(f"histogram layout {dense.significant_figures} digits up to "
                             f"{dense.highest_trackable_value}, expected {sig_figs} up to "
                             f"{HIGHEST}")
        counts = dense.counts[: dense.counts_len]
        if len(counts) != _layout(sig_figs).counts_len:
            raise ValueError("histogram layout does not match this precision's")
        out.counts = {i: counts[i] for i in itertools.compress(range(len(counts)), counts)}
        out.total = sum(out.counts.values())
        return out
