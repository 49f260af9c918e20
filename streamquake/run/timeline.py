"""The run's clock: phase windows, and waiting for their edges while watching the load."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from streamquake.errors import StreamquakeError
from streamquake.loadgen.attribution import Window
from streamquake.scenario import Scenario

# The first window opens once the load processes say they are up (run/launcher.py start_load),
# not after a lead guessed ahead: Locust was up in 0.7 s on a quiet 2-core machine, and took 3 to
# 6.5 s on a busy one (load average 9-12), where a fixed lead either idled or left a short
# warm-up's baseline with no request at all. Workers on other hosts, which the runner cannot
# see come up, get this much from the start to join the master (and Locust's own wait).
REMOTE_LEAD_S = 6.0
TICK_S = 0.5


# A step's window in time: the one window type (loadgen/attribution.py), under the name the
# run's modules know it by.
PhaseWindow = Window


class Load(Protocol):
    def alive(self) -> bool: ...

    def returncode(self) -> int | None: ...


def plan_windows(scenario: Scenario, t0: float) -> list[PhaseWindow]:
    """One window per step of the timeline, named as the step, back to back from ``t0``."""
    windows, t = [], t0
    for step in scenario.timeline:
        windows.append(PhaseWindow(step.name, t, t + step.duration_s))
        t += step.duration_s
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
