"""A phase's time batches: what its measurements were in each of :data:`BATCHES` equal
stretches of time, so that the intervals can measure how much consecutive requests depend on
each other (batch means, loadgen/quantile_ci.py).

Per metric, each value is counted in its stretch's bucket at 2 significant digits (buckets under
1% wide); per rate metric, each stretch's k and n. Stretches are cut from the phase's window,
by when requests were due, so every load process cuts alike and batches merge by adding counts.
Everything is a flat table of integers per cell, whatever the number of batches: cheap to keep
and to merge, and nothing the garbage collector tracks one by one (a Stats per batch made a
100-class run's full collections hold the hub for 50 ms).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamquake.jsontypes import JsonDict
from streamquake.loadgen.histogram import bucket_index, count_ms, pack_pairs, unpack_pairs
from streamquake.loadgen.quantile_ci import BATCHES

SIG_FIGS = 2
_SHIFT = 16                 # key = batch << 16 | bucket (2 digits to an hour: < 3,328 buckets)
_LOW = (1 << _SHIFT) - 1


@dataclass(frozen=True)
class BatchGrid:
    """A phase cut into :data:`BATCHES` equal stretches of time."""

    start: float
    width: float

    @classmethod
    def over(cls, start: float, end: float) -> BatchGrid | None:
        return cls(start, (end - start) / BATCHES) if end > start else None

    def index(self, t: float) -> int:
        i = int((t - self.start) // self.width)
        return 0 if i < 0 else BATCHES - 1 if i >= BATCHES else i


@dataclass
class TimeBatches:
    grid: BatchGrid
    # metric -> {batch << 16 | 2-digit bucket index: count}
    values: dict[str, dict[int, int]] = field(default_factory=dict)
    # rate metric -> [k of batch 0, n of batch 0, k of batch 1, ...]
    trials: dict[str, list[int]] = field(default_factory=dict)
    # The last time placed and its batch's key base: a request's measurements share one time.
    _at: float = field(default=float("nan"), init=False, repr=False, compare=False)
    _base: int = field(default=0, init=False, repr=False, compare=False)

    @classmethod
    def over(cls, start: float, end: float) -> TimeBatches | None:
        grid = BatchGrid.over(start, end)
        return None if grid is None else cls(grid)

    def _key_base(self, at: float) -> int:
        """``at``'s batch, shifted into a key (the last one kept: called for each measurement
        of a request, all at its one time)."""
        if at != self._at:
            self._base = self.grid.index(at) << _SHIFT
            self._at = at
        return self._base

    def record(self, metric: str, at: float, value: int) -> None:
        key = self._key_base(at) | bucket_index(value, SIG_FIGS)
        table = self.values.get(metric)
        if table is None:
            table = self.values[metric] = {}
        table[key] = table.get(key, 0) + 1

    def record_ms(self, metric: str, at: float, values_ms: Iterable[float]) -> None:
        table = self.values.get(metric)
        if table is None:
            table = self.values[metric] = {}
        count_ms(table, values_ms, SIG_FIGS, self._key_base(at))

    def count(self, metric: str, at: float, k: int, n: int) -> None:
        """``k`` of ``n`` more trials of a rate metric."""
        row = self.trials.get(metric)
        if row is None:
            row = self.trials[metric] = [0] * (2 * BATCHES)
        i = 2 * (self._key_base(at) >> _SHIFT)
        row[i] += k
        row[i + 1] += n

    def at_or_below(self, metric: str, value: int) -> list[tuple[int, int]]:
        """Per batch, in time order: (values in the buckets up to the one holding ``value``,
        all values)."""
        top = bucket_index(value, SIG_FIGS)
        k, n = [0] * BATCHES, [0] * BATCHES
        for key, count in self.values.get(metric, {}).items():
            b = key >> _SHIFT
            n[b] += count
            if key & _LOW <= top:
                k[b] += count
        return list(zip(k, n, strict=True))

    def of_rate(self, metric: str) -> list[tuple[int, int]]:
        """Per batch, in time order: (k, n) of a rate metric."""
        row = self.trials.get(metric, [0] * (2 * BATCHES))
        return list(zip(row[::2], row[1::2], strict=True))

    def merge(self, other: TimeBatches) -> None:
        for metric, table in other.values.items():
            mine = self.values.setdefault(metric, {})
            for key, count in table.items():
                mine[key] = mine.get(key, 0) + count
        for metric, row in other.trials.items():
            if (own := self.trials.get(metric)) is None:
                self.trials[metric] = list(row)
            else:
                self.trials[metric] = [a + b for a, b in zip(own, row, strict=True)]

    def to_wire(self) -> JsonDict:
        """The grid, each metric's table as base64 of little-endian uint32 (key, count) pairs,
        and each rate's row of counts."""
        return {"grid": [self.grid.start, self.grid.width],
                "values": {m: _pack(t) for m, t in self.values.items() if t},
                "trials": {m: list(row) for m, row in self.trials.items() if any(row)}}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TimeBatches:
        start, width = data["grid"]
        out = cls(BatchGrid(float(start), float(width)))
        out.values = {str(m): _unpack(packed) for m, packed in data.get("values", {}).items()}
        for m, row in data.get("trials", {}).items():
            if len(row) != 2 * BATCHES:
                raise ValueError(f"time batches of {m!r}: {len(row)} counts, expected "
                                 f"{2 * BATCHES}")
            out.trials[str(m)] = [int(x) for x in row]
        return out


def _pack(table: dict[int, int]) -> str:
    return pack_pairs(table)


def _unpack(packed: str) -> dict[int, int]:
    flat = unpack_pairs(packed, "time batches")
    if any(key >> _SHIFT >= BATCHES for key in flat[::2]):
        raise ValueError("packed time batches: a key past the batches")
    return dict(zip(flat[::2], flat[1::2], strict=True))
