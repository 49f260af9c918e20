"""Named points where a test may SIGKILL this very process: between journaling a change and
making it, and right after making it, where a kill is hardest to recover from. And one where a
freshly forked child SIGKILLs its parent (``spawn.forked``, before it sets its death signal).

``$STREAMQUAKE_KILL_AT`` names one point (unset in normal use: then this is one dictionary
lookup). The kill trials (tests/test_kill_trials.py, scripts/kill-trials) use it to land a
SIGKILL at exactly that instant instead of hoping a timed kill falls there.
``$STREAMQUAKE_KILL_WITH`` sends other signals there instead, in order (``"SIGTERM SIGTERM"``:
an operator who stops a run twice), which the run's own handlers then meet at that instant.
"""

from __future__ import annotations

import os
import signal
import time

POINTS = ("netns.journalled", "netns.created", "tc.journalled", "tc.installed",
          "gpu.journalled", "gpu.set", "spawn.forked", "fault.journalled")
PARENT_GONE_S = 30.0     # how long a child waits to be orphaned: only a hang takes that long


def killpoint(name: str) -> None:
    if os.environ.get("STREAMQUAKE_KILL_AT") == name:
        for sig in os.environ.get("STREAMQUAKE_KILL_WITH", "SIGKILL").split():
            os.kill(os.getpid(), signal.Signals[sig])


def parent_killpoint(name: str, parent: int) -> None:
    """In a child: SIGKILL ``parent`` at the named point and return once it is gone (this child
    orphaned), so that what follows runs in exactly the race it must survive."""
    if os.environ.get("STREAMQUAKE_KILL_AT") != name:
        return
    os.kill(parent, signal.SIGKILL)
    deadline = time.monotonic() + PARENT_GONE_S
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.001)
