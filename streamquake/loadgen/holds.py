"""How long the load process's own bookkeeping holds the gevent hub, per kind of work.

While any code runs on the hub, no socket is read: an event that arrives meanwhile is read,
and dated, when that code gives the hub back (and shares a kernel stamp with whatever else
came in). So every piece of bookkeeping in a load process (scorecard checkpoints, the
timeline's sealed seconds, sample lines, the relay to a master, the saturation guard's own
lines) runs in steps of about a millisecond and yields between them, and measures each step
here. The guard (loadgen/self_measure.py) writes, every second, each kind's count, longest hold
and total, in wall time and in this thread's CPU time: wall time is what the events waited,
CPU time is what the work itself cost (a step preempted by another process on a shared core
is long in wall time only), and a hold over :data:`LIMIT_S` of CPU time is counted apart.
A kernel built without ``CONFIG_IRQ_TIME_ACCOUNTING`` charges the interrupts and softirqs it
serves on a CPU to the thread running there, so on a busy machine a single hold's CPU time can
include network work that is not ours; a hold that recurs run after run is ours.

``STREAMQUAKE_TEST_FREEZE`` ("MS/EVERY_S", test-only, unset in use) makes the process hold its
hub for MS milliseconds every EVERY_S seconds, as bookkeeping of kind ``test_freeze``: the
tests use it to show the guard catches a periodic freeze (tests/test_hub_holds.py).
The interpreter's garbage collections are measured too (kinds ``gc``, young generations, and
``gc_full``): they stop the hub alike (``collector.py`` says when a full one may run). A
collection that runs inside a hold (an allocation there set it off) is its own kind's, not the
hold's: the hold is measured without it, so no stretch of the hub is counted twice and a
sample line that set off a collection is not blamed for its length.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from typing import TypeVar

SLICE_S = 0.0005        # a sliced task yields once a step brings its slice past this
LIMIT_S = 0.010         # a hold of more CPU time than this is counted in ``over``
_GIVE_BACK_S = 1e-6     # a sliced task's sleep between slices: the next loop iteration
FREEZE_ENV = "STREAMQUAKE_TEST_FREEZE"

_clock = time.perf_counter
_cpu = time.thread_time
T = TypeVar("T")
_collected = [0.0, 0.0]   # wall s, CPU s of this process's collections so far (watch_gc)


class Holds:
    """Per kind: [holds, longest wall s, longest CPU s, total wall s, holds over LIMIT_S]."""

    def __init__(self) -> None:
        self._kinds: dict[str, list[float]] = {}

    def add(self, kind: str, wall_s: float, cpu_s: float) -> None:
        k = self._kinds.get(kind)
        if k is None:
            k = self._kinds[kind] = [0, 0.0, 0.0, 0.0, 0]
        k[0] += 1
        if wall_s > k[1]:
            k[1] = wall_s
        if cpu_s > k[2]:
            k[2] = cpu_s
        k[3] += wall_s
        if cpu_s > LIMIT_S:
            k[4] += 1

    def take(self) -> dict[str, list[float]]:
        """The holds since the last take, in ms: kind -> [n, max wall, max CPU, total wall,
        over]."""
        out = {kind: [int(k[0]), round(k[1] * 1e3, 3), round(k[2] * 1e3, 3),
                      round(k[3] * 1e3, 3), int(k[4])]
               for kind, k in self._kinds.items()}
        self._kinds = {}
        return out


HOLDS = Holds()


class Hold:
    """Measures one synchronous stretch of bookkeeping: ``h = Hold(); ...; h.done(kind)``,
    without the garbage collections that ran within it (they are holds of their own)."""

    __slots__ = ("wall", "cpu")

    def __init__(self) -> None:
        # Each start less the collections' time so far: what collections run meanwhile add
        # to both ends alike, so elapsed() leaves them out.
        self.wall = _clock() - _collected[0]
        self.cpu = _cpu() - _collected[1]

    def elapsed(self) -> tuple[float, float]:
        """(wall s, CPU s) since this hold began, less the collections within it."""
        return _clock() - _collected[0] - self.wall, _cpu() - _collected[1] - self.cpu

    def done(self, kind: str) -> None:
        HOLDS.add(kind, *self.elapsed())


def sliced(kind: str, steps: Generator[None, None, T]) -> T:
    """Run ``steps`` (a generator yielding between small units of work) on the hub, giving it
    back whenever a slice has run :data:`SLICE_S`; returns what ``steps`` returns. A hold of
    ``kind`` is what ran between two polls of the loop's sockets: slices that run with no poll
    between them (a loop that resumed this greenlet at once) count as one. Runs under gevent
    only; closes ``steps`` if this greenlet is killed meanwhile."""
    import gevent

    polls = [0]
    check = gevent.get_hub().loop.check(ref=False)   # runs once per loop iteration, after I/O

    def polled() -> None:
        polls[0] += 1

    check.start(polled)
    wall = cpu = 0.0
    seen = polls[0]
    try:
        while True:
            hold = Hold()
            until = _clock() + SLICE_S
            try:
                while True:
                    next(steps)
                    if _clock() >= until:
                        break
            except StopIteration as finished:
                return finished.value  # type: ignore[no-any-return]
            finally:
                if polls[0] != seen and wall:
                    HOLDS.add(kind, wall, cpu)      # the slices since the last poll
                    wall = cpu = 0.0
                hold_wall, hold_cpu = hold.elapsed()
                wall += hold_wall
                cpu += hold_cpu
                seen = polls[0]
            # Not sleep(0): that resumes this greenlet before the loop polls its sockets (up to
            # 50 callbacks in a row), so the slices would add up to one long hold.
            gevent.sleep(_GIVE_BACK_S)
    finally:
        if wall:
            HOLDS.add(kind, wall, cpu)
        check.stop()
        check.close()
        steps.close()


def run_through(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` at once (at the end of a run, or outside gevent); returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]


GC_YOUNG, GC_FULL = "gc", "gc_full"     # collections of generations 0-1, and full ones
GC_KINDS = (GC_YOUNG, GC_FULL)
_gc_started: Hold | None = None


def _on_gc(phase: str, info: dict[str, int]) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = Hold()
    elif _gc_started is not None:
        wall, cpu = _gc_started.elapsed()
        HOLDS.add(GC_FULL if info.get("generation") == 2 else GC_YOUNG, wall, cpu)
        _collected[0] += wall
        _collected[1] += cpu
        _gc_started = None


def watch_gc() -> None:
    """Measure the interpreter's garbage collections as holds of kind ``gc`` (generations 0
    and 1) or ``gc_full``: a full one over many live objects stops the hub like any other work
    (once per process)."""
    import gc

    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def unwatch_gc() -> None:
    global _gc_started
    import gc

    if _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)
    _gc_started = None


def freeze_plan() -> tuple[float, float] | None:
    """(hold s, every s) from ``$STREAMQUAKE_TEST_FREEZE``, or None."""
    raw = os.environ.get(FREEZE_ENV)
    if not raw:
        return None
    hold_ms, _, every_s = raw.partition("/")
    return float(hold_ms) / 1000.0, float(every_s or 2.0)


def test_freezes(hold_s: float, every_s: float) -> None:
    """Test-only: hold the hub for ``hold_s`` every ``every_s`` (a busy loop, as a heavy
    synchronous checkpoint would), measured as bookkeeping."""
    import gevent

    while True:
        gevent.sleep(every_s)
        hold = Hold()
        until = _clock() + hold_s
        while _clock() < until:
            pass
        hold.done("test_freeze")
