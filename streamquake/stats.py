"""Nearest-rank percentiles, the one rule every percentile in streamquake follows: the ``p``-th
percentile of ``n`` values is the value at rank ceil(p/100 * n), the smallest observed value with
at least p% of the values at or below it (what "p99 <= 300 ms" promises)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# p/100 * n in floating point can land a hair above a whole rank (7/100 * 100 = 7.000000000000001)
# and ceil would then take the next one; ranks are whole numbers, so anything this close is equal.
_RANK_EPS = 1e-9


def nearest_rank(p: float, n: int) -> int:
    """The 1-based rank of the ``p``-th percentile (0 <= p <= 100) among ``n`` >= 1 values."""
    return min(n, max(1, math.ceil(p * n / 100.0 - _RANK_EPS)))


def percentile(ordered: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of ``ordered`` (sorted ascending) by nearest rank; None if empty."""
    return ordered[nearest_rank(p, len(ordered)) - 1] if ordered else None


def counts_percentile(counts: Mapping[int, int], p: float) -> int | None:
    """The ``p``-th percentile by nearest rank of values given as ``{value: how many}``."""
    total = sum(counts.values())
    if not total:
        return None
    want, seen = nearest_rank(p, total), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= want:
            return value
    raise AssertionError("unreachable: the counts add up to total")
