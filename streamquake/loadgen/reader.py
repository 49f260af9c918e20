"""One reader for the plain-TCP streams of a load process: their sockets sit in one epoll set,
read in the gevent hub, one read per ready socket per round, and each read's events are folded
into its stream's tally right there. A stream's own greenlet sleeps until its stream has ended
(or failed), and is woken once.

Before it, each read of each stream went through the stream's greenlet: a ``recvmsg`` that
found nothing (raising EAGAIN), a watcher started, a switch to the hub, epoll, a switch back,
the watcher stopped, and the ``recvmsg`` again: about half of an event's CPU at one event per
read (issue 36; ``benchmarks/truth.py`` has the figures). Now a read is the ``recvmsg`` of a
socket epoll said is ready, and nothing else besides what the bytes mean. Where the compiled
part decodes a stream's framing, its step is compiled too (``client._Stream.stepper``:
``speedups.FramedStep``), and a read of the stream's template events is folded in C; so is the
round's loop over the ready sockets (``speedups.read_round``), where the compiled part is built.

What stays on the greenlet's own reads (``client._follow``): TLS sockets (the record layer is
read in user space, where epoll cannot see what is buffered), a slow consumer's paced reads, and
bytes that came with the response headers. Timeouts and cancellations are gevent timers on the
greenlet, as before: they interrupt its wait, and the stream leaves the set on the way out.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Callable
from typing import Any

import gevent
from gevent._waiter import Waiter
from gevent.monkey import get_original

from streamquake.loadgen import speedups

__all__ = ["Reader", "reader"]

_EPOLLIN = getattr(select, "EPOLLIN", 1)

# ``STREAMQUAKE_READER=own`` in the load process's environment: every stream read by its own
# greenlet, as before this module (benchmarks compare the two in one run; tests check that
# both give the same events).
SHARED = os.environ.get("STREAMQUAKE_READER", "shared") != "own"

# Ready sockets read in one round: every one of them once, then the loop runs its timers and
# other watchers before the next round. 64 events of ~15 us: about a millisecond of the hub,
# under the hub-lag probe's 2 ms "blocked" mark (self_measure.BLOCKED_S).
ROUND_MAX = 64
_read_round = speedups.read_round


class _Backlog:
    """What a step returns when its read took a whole block: more was waiting."""


# A step's read filled its whole buffer: the socket has more than a read's worth waiting (a
# target that never lets it run dry, say). It is read again once the loop has nothing else to
# do (an idle watcher), as a greenlet reading its own socket did with ``gevent.idle()``: so
# such a socket cannot keep the loop from ever being idle, nor the other streams from their
# turn.
BACKLOG = _Backlog()

# One read of a stream: None while it goes on (or BACKLOG), else when its terminal event
# arrived (the value the greenlet's wait returns); raises what ends the stream badly.
Step = Callable[[], "float | _Backlog | None"]
# What a round's read came to, where not None: (fd, the step's end or BACKLOG, None), or
# (fd, None, what the step raised).
Outcome = tuple[int, "float | _Backlog | None", "Exception | None"]


class Reader:
    """The epoll set of one hub's streams, and the watcher that reads it."""

    def __init__(self) -> None:
        # The kernel's own epoll: gevent's monkey-patching (Locust's) takes it out of ``select``.
        self._epoll = get_original("select", "epoll")()
        self._steps: dict[int, tuple[Step, Waiter]] = {}
        self._watcher: Any = gevent.get_hub().loop.io(self._epoll.fileno(), 1)   # EV_READ
        self._watcher.start(self._round)
        self._backlogged: set[int] = set()    # out of the set until the loop is idle
        self._idle: Any = gevent.get_hub().loop.idle()
        self.rounds = self.reads = 0      # for tests and benchmarks: what the set did

    def follow(self, fd: int, step: Step) -> float:
        """Read socket ``fd`` with ``step`` whenever it has bytes, until ``step`` returns the
        stream's end (returned here) or raises (raised here, in the caller's greenlet)."""
        waiter = Waiter()
        self._steps[fd] = (step, waiter)
        try:
            self._epoll.register(fd, _EPOLLIN)
            return float(waiter.get())
        finally:
            self._steps.pop(fd, None)
            self._drop(fd)

    def _round(self) -> None:
        """In the hub: one read of every socket epoll says is ready (ROUND_MAX at most), then
        the streams that ended are woken, in order. The loop is compiled where the compiled
        part is built (``speedups.read_round``), else :meth:`_read_round`'s."""
        self.rounds += 1
        if _read_round is None:
            reads, outcomes = self._read_round()
        else:
            reads, outcomes = _read_round(self._epoll.fileno(), self._steps, ROUND_MAX)
        self.reads += reads
        if not outcomes:
            return
        ended: list[tuple[Waiter, float | None, BaseException | None]] = []
        for fd, end, failure in outcomes:
            entry = self._steps.get(fd)
            if entry is None:
                continue
            if failure is not None:         # the stream's own failure, raised in its greenlet
                del self._steps[fd]
                self._drop(fd)
                ended.append((entry[1], None, failure))
            elif end is BACKLOG:
                self._epoll.modify(fd, 0)       # no events until the loop is idle
                self._backlogged.add(fd)
                if not self._idle.active:
                    self._idle.start(self._resume)
            else:
                del self._steps[fd]
                self._drop(fd)
                ended.append((entry[1], float(end), None))     # type: ignore[arg-type]
        for waiter, at, exc in ended:
            if exc is None:
                waiter.switch(at)
            else:
                waiter.throw(type(exc), exc, exc.__traceback__)

    def _read_round(self) -> tuple[int, list[Outcome]]:
        """The round's reads: how many steps ran, and (fd, what it returned, None) for each
        that returned other than None (its end, or BACKLOG), (fd, None, exception) for each
        that raised an Exception (BlockingIOError: nothing after all, a fd number reused
        within the round; skipped). ``speedups.read_round`` is its compiled twin (equal
        answers: tests/test_shared_reader.py)."""
        reads = 0
        outcomes: list[Outcome] = []
        for fd, _mask in self._epoll.poll(0, ROUND_MAX):
            entry = self._steps.get(fd)
            if entry is None:
                continue
            reads += 1
            try:
                end = entry[0]()
            except BlockingIOError:
                continue
            except Exception as exc:
                outcomes.append((fd, None, exc))
                continue
            if end is not None:
                outcomes.append((fd, end, None))
        return reads, outcomes

    def _resume(self) -> None:
        """The loop is idle: the backlogged sockets are read again."""
        self._idle.stop()
        backlogged, self._backlogged = self._backlogged, set()
        for fd in backlogged:
            if fd in self._steps:
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.modify(fd, _EPOLLIN)

    def _drop(self, fd: int) -> None:
        self._backlogged.discard(fd)
        # Not there (ended in a round, never registered): epoll says so, and that is fine.
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)


def reader() -> Reader | None:
    """This hub's reader, made on first use; None where there is no epoll (not Linux), or
    where the streams are read by their own greenlets (``SHARED``)."""
    if not SHARED or not sys.platform.startswith("linux"):
        return None
    hub = gevent.get_hub()
    got: Reader | None = getattr(hub, "_sq_reader", None)
    if got is None:
        got = Reader()
        hub._sq_reader = got
    return got
