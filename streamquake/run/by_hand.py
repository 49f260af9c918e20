"""Faults held by hand on this machine while a run runs: ``streamquake inject`` (or a
controller) through the local agent, for an owner that is not this run. Their effect is in the
run's figures and nothing else would say so: the live view said ``faults: none`` while one was
on. A thread asks the local agent every few seconds (its file says whether one runs: no network
when none does); the runner reads what it last heard, names each such fault in the live view and
warns once per fault with the step it was seen in."""

from __future__ import annotations

import threading

from streamquake.agent.local import find_local_agent
from streamquake.agentwire.api import HeldFault
from streamquake.errors import InjectorError

POLL_S = 2.0
READ_TIMEOUT_S = 2.0


class ByHand:
    def __init__(self, owner: str, every_s: float = POLL_S) -> None:
        self.owner = owner
        self.every_s = every_s
        self._held: tuple[HeldFault, ...] = ()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sq-by-hand", daemon=True)

    def __enter__(self) -> ByHand:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(READ_TIMEOUT_S + 4.0)   # connect (3 s) + read: never a hang

    def held(self) -> tuple[HeldFault, ...]:
        """The faults of other owners the local agent held when last asked."""
        with self._lock:
            return self._held

    def _loop(self) -> None:
        while not self._stop.is_set():
            found = find_local_agent()
            held: tuple[HeldFault, ...] = ()
            if found is not None:
                client = found.client()
                client.read_timeout_s = READ_TIMEOUT_S
                try:
                    held = tuple(f for f in client.faults().faults if f.owner != self.owner)
                except (InjectorError, OSError, ValueError):
                    held = self.held()     # unanswered: what it said last
            with self._lock:
                self._held = held
            self._stop.wait(self.every_s)
