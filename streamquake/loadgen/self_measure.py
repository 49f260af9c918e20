"""Is the load process keeping up? Its own view, second by second, for the runner to judge.

A saturated load generator lies: its greenlets read sockets late, so the gaps it measures are
its own, not the server's. Each load process that runs users measures, every second:

* its CPU share (``os.times``: user + system over wall time; a gevent process uses one core);
* the gevent hub's lag: a greenlet sleeps :data:`PROBE_S` again and again and records how late
  each wake-up comes (a loop busy elsewhere, or a process waiting for a core, wakes it late);
* per event, the gap between the kernel's receive timestamp and the moment our code saw the
  bytes (``client.py`` reports it for every read that carried a kernel timestamp);
* whether its reads were batched (``batching.py``, which this guard engages and lets go once
  a second): the interval in effect over the second, ``read_batch_ms``;
* how long its own bookkeeping held the hub, per kind of work (``holds.py``): checkpoints,
  sealed seconds, sample lines, the relay, this guard's own lines; and how long the
  interpreter's garbage collector held it, the longest collection of the second apart
  (``gc_max_ms``: the collector's pauses are its own, not the server's).

One JSON line a second goes to ``saturation-<pid>.jsonl`` next to the load plan (the run
directory, beside ``locust.log``; never the samples directory, whose ``*.jsonl`` are samples),
flushed per line. ``run/saturation.py`` reads them and decides.

The blocked stretches of the loop (a wake-up later than :data:`BLOCKED_S`) are also kept for a
minute, so that the client can tell a stall of its own (the loop was late) from the server's.
Runs under gevent only through :func:`start`; the other functions are safe anywhere.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import IO, Protocol

from streamquake.loadgen.batching import Batching
from streamquake.loadgen.holds import GC_KINDS, HOLDS, Hold, unwatch_gc, watch_gc

PROBE_S = 0.05          # the hub-lag probe's sleep: 20 wake-ups a second
BLOCKED_S = 0.002       # a wake-up later than this marks the loop blocked over that stretch
_KEEP_BLOCKED = 1200    # blocked stretches kept for stall attribution (a minute at worst)
SEEN_BUCKETS_PER_E = 20  # kernel-to-seen gaps are kept in log buckets 5% wide
FILE_PREFIX = "saturation-"

_guard: Guard | None = None
# Requests of this process sent and not yet ended (the client counts them): each second's
# line says how many, so a live view shows streams that hang, which end no sample.
IN_FLIGHT = [0]


class _Greenlet(Protocol):
    def kill(self) -> None: ...


_greenlet: _Greenlet | None = None
_log = math.log


def bucket_ms(bucket: int) -> float:
    """The value a bucket stands for, in ms (its lower edge: never overstates a gap)."""
    return math.exp(bucket / SEEN_BUCKETS_PER_E) / 1000.0


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Guard:
    """The measurements of one load process; :meth:`run` is its probe greenlet."""

    def __init__(self, sink: IO[str], batching: Batching | None = None) -> None:
        self._sink = sink
        self._batching = batching
        self._lags_ms: list[float] = []
        self._seen: dict[int, int] = {}
        self._seen_max_s = 0.0
        self._kernel_reads = 0
        self._user_reads = 0
        self._blocked: deque[tuple[float, float]] = deque(maxlen=_KEEP_BLOCKED)
        self._next_due = math.inf

    # Called by the client, from any greenlet, once per read.
    def seen(self, gap_s: float, events: int) -> None:
        """``events`` events arrived ``gap_s`` before our code saw them (kernel-timed read)."""
        # Its log bucket: exp(b / 20) microseconds, 5% wide (bucket_ms reads it back).
        us = gap_s * 1e6
        b = int(_log(us) * SEEN_BUCKETS_PER_E) if us > 1.0 else 0
        self._seen[b] = self._seen.get(b, 0) + events
        self._kernel_reads += 1
        if gap_s > self._seen_max_s:
            self._seen_max_s = gap_s

    def user_read(self) -> None:
        self._user_reads += 1

    def blocked_within(self, start: float, end: float) -> float:
        """Seconds within [start, end] (perf_counter) during which the hub was late: the
        union of blocked stretches, including one still going on now."""
        # The stretches are kept in time order, none overlapping (each begins after the last
        # one's wake-up): from the newest back to the first that ended by ``start``. A scan of
        # all of them (up to _KEEP_BLOCKED, the last minute's) cost every request, and every
        # read after a long wait, tens of microseconds once the hub had often been late: the
        # load process's bookkeeping grew with its own trouble.
        spans: list[tuple[float, float]] = []
        for a, b in reversed(self._blocked):
            if b <= start:
                break
            if a < end:
                spans.append((a, b))
        spans.reverse()
        if self._next_due < end:
            spans.append((self._next_due, end))
        total, reach = 0.0, start
        for a, b in spans:
            a, b = max(a, reach), min(b, end)
            if b > a:
                total += b - a
                reach = b
        return total

    def close(self) -> None:
        if self._batching is not None:
            self._batching.close()
        self._sink.close()

    def run(self) -> None:
        import gevent

        clock = time.perf_counter
        HOLDS.take()        # the first second counts only what happens in it
        second_at, second_wall, cpu_at = clock(), time.time(), _cpu_s()
        due = clock() + PROBE_S
        while True:
            self._next_due = due
            gevent.sleep(max(0.0, due - clock()))
            woke = clock()
            late = max(0.0, woke - due)
            self._lags_ms.append(late * 1000.0)
            if late > BLOCKED_S:
                self._blocked.append((due, woke))
            # From the wake-up, not the old due time: one long block counts once, not as a
            # burst of late catch-up wake-ups.
            due = woke + PROBE_S
            if woke - second_at >= 1.0:
                cpu, wall = _cpu_s(), time.time()
                self._write(second_wall, wall, (cpu - cpu_at) / (woke - second_at) * 100.0)
                second_at, second_wall, cpu_at = woke, wall, cpu

    def _write(self, start: float, end: float, cpu_pct: float) -> None:
        hold = Hold()
        holds = HOLDS.take()
        batching = self._batching
        record: dict[str, object] = {
            "pid": os.getpid(), "start": round(start, 3), "end": round(end, 3),
            "cpu_pct": round(cpu_pct, 1),
            "lag_ms": [round(v, 2) for v in self._lags_ms],
            "seen_max_ms": round(self._seen_max_s * 1000.0, 3),
            "seen": {str(b): n for b, n in sorted(self._seen.items())},
            "kernel_reads": self._kernel_reads, "user_reads": self._user_reads,
            "holds": holds,
            # The longest the interpreter's garbage collector held the hub: its own figure.
            "gc_max_ms": max((h[1] for k, h in holds.items() if k in GC_KINDS), default=0.0),
            "in_flight": IN_FLIGHT[0],
            # The read batching's interval over this second (0: each event read at once).
            "read_batch_ms": 0.0 if batching is None else round(batching.interval_s * 1e3, 3),
        }
        if batching is not None:
            batching.update(cpu_pct, self._user_reads)     # for the next second
        self._lags_ms, self._seen, self._seen_max_s = [], {}, 0.0
        self._kernel_reads = self._user_reads = 0
        try:
            self._sink.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._sink.flush()
        except (OSError, ValueError):
            pass    # a full disk (or a closed file at exit) must not stop the load
        hold.done("guard")      # in the next second's line


def active() -> Guard | None:
    """The guard of this process, if :func:`start` ran in it."""
    return _guard


def start(runner: object, directory: Path | None = None,
          sink: IO[str] | None = None) -> Guard | None:
    """Start the guard in a load process that runs users (not a Locust master): one greenlet,
    one file. ``directory`` defaults to the load plan's directory (``$STREAMQUAKE_LOAD_PLAN``)."""
    global _guard, _greenlet
    import gevent

    if _guard is not None:
        return _guard
    if runner is not None:
        from locust.runners import MasterRunner

        if isinstance(runner, MasterRunner):
            return None     # the master runs no users: nothing of its timing is measured
    if sink is None:    # a remote worker passes its relay (loadgen/relay.py) instead
        if directory is None:
            from streamquake.loadgen.plan import PLAN_ENV

            directory = Path(os.environ[PLAN_ENV]).parent
        sink = open(directory / f"{FILE_PREFIX}{os.getpid()}.jsonl", "a",  # noqa: SIM115
                    encoding="utf-8")
    _guard = Guard(sink, Batching.for_hub())
    _greenlet = gevent.spawn(_guard.run)
    watch_gc()
    return _guard


def stop() -> None:
    """Stop this process's guard and close its file (the tests run several in one process)."""
    global _guard, _greenlet
    if _greenlet is not None:
        _greenlet.kill()
    if _guard is not None:
        _guard.close()
    unwatch_gc()
    _guard = _greenlet = None
