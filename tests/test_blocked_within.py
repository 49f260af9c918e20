"""The guard's account of when the hub was late (``Guard.blocked_within``), read backwards from
the newest stretch: the same answer as the union of every kept stretch within the window."""

from __future__ import annotations

import io
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from streamquake.loadgen.self_measure import BLOCKED_S, PROBE_S, Guard


def _union_within(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """The length of the union of ``spans`` cut to [start, end], by merging them all."""
    cut = sorted((max(a, start), min(b, end)) for a, b in spans if min(b, end) > max(a, start))
    total, reach = 0.0, -math.inf
    for a, b in cut:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(BLOCKED_S * 1.01, 0.4)),
                  max_size=40),
    waiting=st.one_of(st.none(), st.floats(0.0, 0.3)),
    window=st.tuples(st.floats(-0.1, 12.0), st.floats(0.0, 3.0)),
)
def test_blocked_within_is_the_union_of_the_stretches_in_the_window(
        gaps: list[tuple[float, float]], waiting: float | None,
        window: tuple[float, float]) -> None:
    # As the probe keeps them: each stretch from a due time to a late wake-up, the next due
    # PROBE_S after that wake-up, or later; the one going on now from the next due time.
    guard = Guard(io.StringIO())
    spans: list[tuple[float, float]] = []
    woke = 0.0
    for idle, late in gaps:
        due = woke + PROBE_S + idle
        woke = due + late
        guard._blocked.append((due, woke))
        spans.append((due, woke))
    start, length = window
    end = start + length
    if waiting is not None:
        guard._next_due = woke + PROBE_S + waiting
        if guard._next_due < end:
            spans.append((guard._next_due, end))
    assert math.isclose(guard.blocked_within(start, end), _union_within(spans, start, end),
                        abs_tol=1e-9)
