"""Read batching: while a load process is busy, its gevent loop polls its sockets at most once
every :data:`COLLECT_S`, and reads everything that came meanwhile in one round.

Unbatched, a busy load process wakes for almost every event: at 500 streams (22,000 events/s)
its loop went round ~10,000 times a second, each round an ``epoll_wait`` of the loop's, one of
the shared reader's (``reader.py``) and the reads of the one or two sockets that were ready,
and it slept and woke ~4,000 times a second between them. libev can wait a little before it
polls (``ev_set_io_collect_interval``): with 0.5 ms the load process took 15% less CPU per
event with one request class and 12% less with 100 (``benchmarks/truth.py --streams 500``,
alternated runs each way; benchmarks/README.md).

What it costs the times, and why that is small:

* An event's time is the kernel's receive stamp of its read (``stamps.py``), taken when its
  bytes arrived, not when the loop read them: reading later does not move it. Only two events
  of one stream that arrive within the interval are read together and share a stamp (the
  later one: the earlier event is dated late by their gap, under COLLECT_S, and the sample
  counts the shared stamp, ``shared_stamps``). Tokens come 10-50 ms apart from real engines.
* Timers are not delayed (libev sleeps no longer than its next timer), nor are callbacks
  already due: a user's scheduled arrival, a timeout, a greenlet switch.
* A time taken by our code when a wait on a socket ends is late by up to COLLECT_S: a connect,
  a write that waited for room, a read without a kernel stamp (TLS, a slow consumer's). So
  batching is only engaged while every read of the last second had a kernel stamp, and is let
  go at the first second with one that did not.

It is engaged when the load process used :data:`ENGAGE_CPU_PCT` of a core over a second, and let
go below :data:`RELEASE_CPU_PCT` (lightly loaded, the loop has time to read each event at once,
and nothing to save). The saturation guard (``self_measure.py``) decides it once a second and
writes the interval in effect in each second's line (``read_batch_ms``); the run's report says
for how many seconds of each phase it was engaged (``run/saturation.py``).

``STREAMQUAKE_READ_BATCHING`` in the load process's environment: ``auto`` (the default), ``off``
(never), ``on`` (always, whatever the load), or an interval in ms, always on (the tests);
``streamquake run`` refuses any other value before it starts. Where the loop is not gevent's
libev one (``GEVENT_LOOP=libuv``), there is nothing to set and reads are never batched.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Mapping

COLLECT_S = 0.0005
ENGAGE_CPU_PCT = 50.0
RELEASE_CPU_PCT = 35.0
ENV = "STREAMQUAKE_READ_BATCHING"
MODES = ("auto", "off", "on")
MAX_MS = 100.0


def setting(environ: Mapping[str, str]) -> tuple[str, float]:
    """:data:`ENV`'s mode and interval in ``environ`` (ValueError: a value it cannot take)."""
    return _parse(environ.get(ENV) or "auto")


def _parse(text: str) -> tuple[str, float]:
    """A setting's mode and the interval it batches at: ``auto``, ``off``, ``on`` (COLLECT_S),
    or a number of ms (on, at that interval: the tests)."""
    mode = text.strip().lower()
    if mode in MODES:
        return mode, COLLECT_S
    try:
        ms = float(mode)
    except ValueError:
        ms = math.nan
    if not 0.0 < ms <= MAX_MS:      # nan too
        raise ValueError(f"{ENV}={text!r}: expected one of {', '.join(MODES)}, or an interval "
                         f"in ms over 0 and at most {MAX_MS:g} (always on at that interval)")
    return "on", ms / 1000.0


def loop_setter(loop: object) -> Callable[[float], None] | None:
    """What sets ``loop``'s I/O collect interval (seconds), or None where it cannot be set."""
    try:
        from gevent.libev import corecext
    except ImportError:
        return None
    ptr = getattr(loop, "ptr", None)
    if not isinstance(loop, corecext.loop) or not isinstance(ptr, int) or not ptr:
        return None
    try:
        fn = ctypes.CDLL(corecext.__file__).ev_set_io_collect_interval
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_double]
    fn.restype = None

    def set_interval(seconds: float) -> None:
        fn(ptr, seconds)

    return set_interval


class Batching:
    """The read batching of one loop: :meth:`update` once a second, :meth:`close` at the end."""

    def __init__(self, setter: Callable[[float], None] | None, mode: str | None = None) -> None:
        self.mode, self._on_s = setting(os.environ) if mode is None else _parse(mode)
        self._set = setter
        self.interval_s = 0.0
        if self.mode == "on":
            self._apply(self._on_s)

    @classmethod
    def for_hub(cls) -> Batching:
        import gevent

        return cls(loop_setter(gevent.get_hub().loop))

    @property
    def available(self) -> bool:
        return self._set is not None

    def update(self, cpu_pct: float, user_reads: int) -> float:
        """Decide from the second just measured (the process's CPU share, its reads without a
        kernel stamp); return the interval now in effect, seconds (0: not batching)."""
        if self.mode == "auto":
            if user_reads or cpu_pct < RELEASE_CPU_PCT:
                self._apply(0.0)
            elif cpu_pct >= ENGAGE_CPU_PCT:
                self._apply(self._on_s)
        return self.interval_s

    def close(self) -> None:
        """Polls at once again (the loop outlives a guard in the tests)."""
        self._apply(0.0)

    def _apply(self, seconds: float) -> None:
        if self._set is None or seconds == self.interval_s:
            return
        self._set(seconds)
        self.interval_s = seconds
