"""Timing in tests without absolute wall-clock bounds that a slow or shared machine can cross.

* ``wait_until``: poll a condition up to a deadline that only a hang reaches, instead of
  sleeping a fixed time and then asserting.
* ``cli_start_s``: the CLI's own start-up here and now (``streamquake recover`` on an empty
  journal: interpreter, imports, reading a journal), the baseline that a CLI command's time is
  compared with inside the same test (a User-Mode Linux guest or a busy 2-core box makes both
  slower alike).
* ``timed_recover`` and ``recover_bound_s``: how long ``streamquake recover`` took, and may
  take, against that baseline.
* ``cpu_s``: CPU seconds of this process spent in a call, for comparing an algorithm's cost with
  a baseline of known cost measured in the same test (competing load does not inflate it).

``scripts/test-stress`` runs the suite with every core kept busy, to show that none of this
depends on an idle machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HANG_S = 60.0     # the default deadline for a wait: only a hang takes this long


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = HANG_S,
               interval_s: float = 0.02) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail the test
    (saying ``what`` was awaited) only if ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def cli_start_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds that ``streamquake recover`` takes on an empty journal, measured now with the
    same interpreter and environment (its state directory aside): the CLI's start-up."""
    base = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="sq-cli-start-") as state:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "streamquake", "recover"],
                              env={**base, "STREAMQUAKE_STATE_DIR": state}, cwd=REPO,
                              capture_output=True, text=True, timeout=HANG_S * 5)
        took = time.monotonic() - started
    assert done.returncode == 0 and "nothing to recover" in done.stdout, done.stderr
    return took


# What `recover` may take, from the CLI's start-up measured around it (the larger of two
# measurements, one before and one after: a single one on a busy host can come out low): its
# own start-up and the work of undoing (pyroute2's netlink, tc, NVML), together 1.2-3.3 times
# that start-up as measured here and in UML on a busy host, and at most one short answer from
# a dying SSE proxy (its _RECOVER_TIMEOUT_S, 1 s). The defect this guards against blocked ~20 s
# on a dying proxy, on top of all that: above the bound wherever the start-up is under ~6 s.
RECOVER_START_FACTOR = 4.0
RECOVER_WAIT_S = 2.0


def recover_bound_s(start_s: float) -> float:
    return RECOVER_START_FACTOR * start_s + RECOVER_WAIT_S


def timed_recover(recover: Callable[[], T], env: Mapping[str, str] | None = None
                  ) -> tuple[T, float, float]:
    """(what ``recover()`` returned, seconds it took, the CLI's start-up around it)."""
    before_s = cli_start_s(env)
    started = time.monotonic()
    out = recover()
    took = time.monotonic() - started
    return out, took, max(before_s, cli_start_s(env))


def cpu_s(fn: Callable[[], T]) -> tuple[T, float]:
    """(what ``fn()`` returned, CPU seconds this process spent in it)."""
    started = time.process_time()
    out = fn()
    return out, time.process_time() - started


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from /proc."""
    kids: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            child = int(stat.parent.name)
            kids |= {child} | descendants(child)
    return kids
