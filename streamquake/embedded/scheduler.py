"""The embedded target's priority-aware scheduler (``target.embedded.scheduler``): which waiting
stream takes a free slot of ``capacity``.

A stream asks with its request's ``priority`` (vLLM's body field, 0 first, up to 3) and waits in
one queue ordered by priority, then arrival. A free slot goes to the first waiting stream whose
priority is under its ``per_priority`` limit. With ``preempt``, a P0 that finds every slot taken
evicts the lowest-priority stream still *forming* (admitted, its first token not yet sent; the
latest admitted of those): the evicted one goes back to the queue at its old place and, once
readmitted, waits a fresh time to its first token, as an engine recomputes a pre-empted
prefill. A stream that has sent a token is never evicted.

Per priority, it counts what ``GET /scheduler`` reports: streams admitted, their queue waits
(every wait of a stream, a pre-empted one's second wait too), and pre-emptions.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from streamquake.embedded.config import PRIORITIES, Scheduler
from streamquake.jsontypes import JsonDict


@dataclass(eq=False)
class Ticket:
    """One stream's place with the scheduler."""

    priority: int
    seq: int                                 # arrival order, kept when pre-empted
    queued_at: float = 0.0                   # loop time it last joined the queue
    admitted: asyncio.Future[None] | None = None
    running: bool = False
    forming: bool = False                    # admitted, its first token not yet sent
    evicted: asyncio.Event = field(default_factory=asyncio.Event)
    preemptions: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.seq)


@dataclass
class PriorityStats:
    admitted: int = 0                        # streams (a stream readmitted counts once)
    waits: int = 0
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0
    preempted: int = 0

    def report(self) -> JsonDict:
        mean = self.wait_s_total / self.waits if self.waits else 0.0
        return {"admitted": self.admitted, "waits": self.waits,
                "wait_ms_mean": round(mean * 1000, 3),
                "wait_ms_max": round(self.wait_s_max * 1000, 3), "preempted": self.preempted}


class PriorityScheduler:
    def __init__(self, capacity: int, spec: Scheduler) -> None:
        self.capacity = capacity
        self.spec = spec
        self.limits = dict(spec.per_priority)
        self.free = capacity
        self.running: list[Ticket] = []
        self.queue: list[Ticket] = []            # sorted by (priority, seq)
        self.in_batch = dict.fromkeys(PRIORITIES, 0)
        self.stats = {p: PriorityStats() for p in PRIORITIES}
        self._seq = 0

    def ticket(self, priority: int) -> Ticket:
        self._seq += 1
        return Ticket(priority, self._seq)

    def _fits(self, priority: int) -> bool:
        limit = self.limits.get(priority)
        return self.free > 0 and (limit is None or self.in_batch[priority] < limit)

    def _take(self, t: Ticket, now: float, first: bool) -> None:
        self.free -= 1
        self.in_batch[t.priority] += 1
        self.running.append(t)
        t.running, t.forming = True, True
        s = self.stats[t.priority]
        waited = now - t.queued_at
        s.waits += 1
        s.wait_s_total += waited
        s.wait_s_max = max(s.wait_s_max, waited)
        if first:
            s.admitted += 1

    def _leave(self, t: Ticket) -> None:
        self.running.remove(t)
        t.running, t.forming = False, False
        self.free += 1
        self.in_batch[t.priority] -= 1

    def _dispatch(self, now: float) -> None:
        """Free slots to the waiting streams, by priority then arrival, within the limits."""
        i = 0
        while self.free > 0 and i < len(self.queue):
            t = self.queue[i]
            if not self._fits(t.priority):
                i += 1
                continue
            del self.queue[i]
            self._take(t, now, first=t.preemptions == 0)
            if t.admitted is not None and not t.admitted.done():
                t.admitted.set_result(None)

    def _preempt_for(self, t: Ticket) -> None:
        """A P0 finding the batch full evicts the lowest-priority forming stream, the latest
        admitted of those."""
        limit = self.limits.get(t.priority)
        if not (self.spec.preempt and t.priority == 0 and self.free == 0) or (
                limit is not None and self.in_batch[t.priority] >= limit):
            return                    # (at its own limit, a freed slot would not be its)
        forming = [r for r in self.running if r.forming and r.priority > t.priority]
        if not forming:
            return
        victim = max(forming, key=lambda r: (r.priority, r.seq))
        self._leave(victim)
        victim.preemptions += 1
        self.stats[victim.priority].preempted += 1
        victim.evicted.set()

    async def acquire(self, t: Ticket) -> None:
        """Wait for a slot; on return ``t`` holds one."""
        loop = asyncio.get_running_loop()
        t.queued_at = loop.time()
        t.admitted = loop.create_future()
        bisect.insort(self.queue, t, key=lambda q: q.key)
        self._preempt_for(t)
        self._dispatch(t.queued_at)
        try:
            await t.admitted
        except asyncio.CancelledError:
            self.release(t)
            raise

    def release(self, t: Ticket) -> None:
        """``t`` leaves: its slot (if it holds one) goes to the next waiting stream. Safe twice,
        and for a stream still waiting (a client that hung up in the queue)."""
        if t.running:
            self._leave(t)
        elif t in self.queue:
            self.queue.remove(t)
        self._dispatch(asyncio.get_running_loop().time())

    async def form(self, t: Ticket, wait_s: float, again: Callable[[], float]) -> None:
        """The wait for ``t``'s first token: ``wait_s``, unless a P0 evicts it first; then it
        queues again and, readmitted, waits ``again()``. On return its first token may go."""
        while True:
            try:
                async with asyncio.timeout(max(0.0, wait_s)):
                    await t.evicted.wait()
            except TimeoutError:
                pass
            if not t.evicted.is_set():          # (evicted as the time ran out: it still is)
                t.forming = False
                return
            t.evicted.clear()
            await self.acquire(t)
            wait_s = again()

    def report(self) -> JsonDict:
        running: JsonDict = {str(p): n for p, n in self.in_batch.items()}
        waiting: JsonDict = {str(p): sum(1 for t in self.queue if t.priority == p)
                             for p in PRIORITIES}
        limits: JsonDict = {str(p): n for p, n in self.limits.items()}
        per: JsonDict = {str(p): s.report() for p, s in self.stats.items()}
        return {"policy": self.spec.policy, "capacity": self.capacity, "per_priority": limits,
                "preempt": self.spec.preempt, "streams": self._seq, "running": running,
                "waiting": waiting,
                "priorities": per}


@asynccontextmanager
async def slot(scheduler: PriorityScheduler, t: Ticket) -> AsyncIterator[Ticket]:
    """Inside: ``t`` holds a slot (or is being pre-empted and re-queued by ``form``)."""
    await scheduler.acquire(t)
    try:
        yield t
    finally:
        scheduler.release(t)


def add_routes(app: web.Application, scheduler: PriorityScheduler) -> None:
    """``GET /scheduler``: the batch now and each priority's queue waits so far."""

    async def report(request: web.Request) -> web.Response:
        return web.json_response(scheduler.report())

    app.router.add_get("/scheduler", report)
