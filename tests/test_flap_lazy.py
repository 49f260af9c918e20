"""A flapping fault in a long step (issue 37, 4): its on-intervals are drawn as the run reaches
them, so planning a window of any length costs the same small memory, and the edges are the
ones the whole list would have given."""

from __future__ import annotations

import itertools
import tracemalloc
from typing import Any

import pytest

from streamquake.faults.flap import Flap
from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.run.flapping import Flapper
from streamquake.run.ledger import PlannedFault
from streamquake.run.timeline import PhaseWindow


def _fault(flap: dict[str, Any]) -> PlannedFault:
    spec = SSEProxyFault.model_validate({"type": "sse_proxy", "name": "f", "phase": "fault",
                                         "delay": "1ms", "flap": flap})
    return PlannedFault(spec=spec, injector=None, phase="fault")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_planning_a_long_window_draws_no_interval_ahead() -> None:
    """2*10^5 s flapping every 100 ms is 10^6 on-intervals: built whole (the old plan) that is
    about 100 MB; drawn lazily, planning and asking for the first edge take a few KB."""
    fault = _fault({"on": "100ms", "off": "100ms"})
    tracemalloc.start()
    try:
        flapper = Flapper.plan(fault, PhaseWindow("fault", 1000.0, 1000.0 + 2e5), seed=1)
        first = flapper.next_edge()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"\npeak while planning 10^6 on-intervals: {peak / 1024:.0f} KiB")
    assert first == pytest.approx(1000.0)
    assert peak < 1 << 20, peak


@pytest.mark.timeout(30)
def test_lazy_edges_are_the_planned_ones() -> None:
    flap = Flap.model_validate({"on": {"mean": "150ms", "max": "300ms"},
                                "off": {"mean": "100ms", "max": "200ms"}, "seed": 4})
    whole = flap.on_intervals(30.0, 0, "f")
    lazy = list(itertools.islice(flap.iter_on_intervals(30.0, 0, "f"), len(whole) + 5))
    assert lazy == whole and len(whole) > 20
