"""Every event the runner emits, declared in one place as a typed record. Reporters and the live
view subscribe by event class; the runner never calls them by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from streamquake.result import FaultRecord, RunResult

if TYPE_CHECKING:
    from streamquake.run.watch import RollingStats
    from streamquake.scenario import Scenario


@dataclass(frozen=True)
class RunStarted:
    """Once the parts are up and preflight passed; the first phase begins at ``starts_at``
    (epoch s)."""

    scenario: Scenario
    out_dir: Path
    starts_at: float


@dataclass(frozen=True)
class PhaseStarted:
    """At each phase edge; ``start`` is the planned edge (epoch s), the one the load processes
    score by."""

    phase: str
    duration_s: float
    start: float


@dataclass(frozen=True)
class FaultApplied:
    """After a fault is in place, with its read-back in ``record.applied``."""

    record: FaultRecord


@dataclass(frozen=True)
class FaultReverted:
    """After a fault is undone, or failed to be (``record.error``)."""

    record: FaultRecord


@dataclass(frozen=True)
class RunFinished:
    """After verdicts are computed, before reports are written."""

    result: RunResult


@dataclass(frozen=True)
class Tick:
    """About twice a second while phases run: the rolling statistics of the last seconds."""

    stats: RollingStats


@dataclass(frozen=True)
class HeldByHand:
    """With each tick: the faults held here by hand, not by this run (run/by_hand.py), as
    ``name (type)``; empty when none is."""

    faults: tuple[str, ...]


@dataclass(frozen=True)
class Message:
    """A line for humans: starting parts, waiting, reverting..."""

    text: str


Event = (RunStarted | PhaseStarted | FaultApplied | FaultReverted | RunFinished | Tick | HeldByHand
         | Message)
EVENTS: tuple[type[Event], ...] = (RunStarted, PhaseStarted, FaultApplied, FaultReverted,
                                   RunFinished, Tick, HeldByHand, Message)
E = TypeVar("E", RunStarted, PhaseStarted, FaultApplied, FaultReverted, RunFinished, Tick,
            HeldByHand, Message)


class Events:
    def __init__(self) -> None:
        self._handlers: dict[type[Event], list[Callable[[Event], None]]] = {k: [] for k in EVENTS}

    def on(self, kind: type[E], handler: Callable[[E], None]) -> None:
        self._handlers[kind].append(handler)  # type: ignore[arg-type]

    def emit(self, event: Event) -> None:
        for handler in self._handlers[type(event)]:
            handler(event)

    def message(self, text: str) -> None:
        self.emit(Message(text))
