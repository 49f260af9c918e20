"""The run's clock: phase windows, and waiting for their edges while watching the load."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from streamquake.errors import StreamquakeError
from streamquake.scenario import PHASE_ORDER, Scenario

STARTUP_LEAD_S = 3.0
TICK_S = 0.5        # time the load process gets to import Locust and spawn users


@dataclass(frozen=True)
class PhaseWindow:
    name: str
    start: float
    end: float


class Load(Protocol):
    def alive(self) -> bool: ...

    def returncode(self) -> int | None: ...


def plan_windows(scenario: Scenario, t0: float) -> list[PhaseWindow]:
    windows, t = [], t0
    for phase in PHASE_ORDER:
        d = scenario.phases.duration_s(phase)
        if d > 0:
            windows.append(PhaseWindow(phase, t, t + d))
            t += d
    return windows


def sleep_until(deadline: float, load: Load, log_dir: Path,
                tick: Callable[[], bool] | None = None) -> bool:
    """Sleep to ``deadline``; the load generator must stay up all the while. ``tick`` runs
    about twice a second; when it returns True the sleep ends early (and this returns True)."""
    next_tick = 0.0
    while (left := deadline - time.time()) > 0:
        if not load.alive():
            raise StreamquakeError(
                f"the load generator stopped early (code {load.returncode()}); "
                f"see {log_dir / 'locust.log'}"
            )
        if tick is not None and time.monotonic() >= next_tick:
            next_tick = time.monotonic() + TICK_S
            if tick():
                return True
        time.sleep(min(0.2, left))
    return False
