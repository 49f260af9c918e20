"""Named points where a test may SIGKILL this very process: between journaling a change and
making it, and right after making it, where a kill is hardest to recover from.

``$STREAMQUAKE_KILL_AT`` names one point (unset in normal use: then this is one dictionary
lookup). The kill trials (tests/test_kill_trials.py, scripts/kill-trials) use it to land a
SIGKILL at exactly that instant instead of hoping a timed kill falls there.
"""

from __future__ import annotations

import os
import signal

POINTS = ("netns.journalled", "netns.created", "tc.journalled", "tc.installed",
          "gpu.journalled", "gpu.set")


def killpoint(name: str) -> None:
    if os.environ.get("STREAMQUAKE_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
