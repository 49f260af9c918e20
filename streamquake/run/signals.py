"""SIGINT and SIGTERM during a run: they end it, but never in the middle of a revert."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

from streamquake.run.events import Events

_SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class Interrupted(Exception):
    def __init__(self, signame: str) -> None:
        super().__init__(f"interrupted by {signame}")
        self.signame = signame


class Signals:
    """SIGINT/SIGTERM become ``Interrupted``, but never inside ``shield()``: a signal that
    arrives while a fault is being reverted is held until the revert is done, so a second
    Ctrl-C cannot cancel a revert."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.shielded = False
        self.raised: str | None = None       # the signal already turned into Interrupted
        self.held: str | None = None         # one that arrived while shielded
        self._old: dict[int, _SignalHandler] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.shielded or self.raised:
            self.held = self.held or name
            self.events.message(f"{name} received: still reverting faults, please wait")
            return
        self.raised = name
        raise Interrupted(name)

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        before, self.shielded = self.shielded, True
        try:
            yield
        finally:
            self.shielded = before
        if self.held and not self.raised and not before:
            self.raised = self.held
            raise Interrupted(self.held)

    def __enter__(self) -> Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
