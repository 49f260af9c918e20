"""Every event the runner emits, declared in one place. Reporters and the live view listen;
the runner never calls them by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Handler = Callable[..., None]

EVENTS: dict[str, str] = {
    "run_started": "(scenario, out_dir) once the parts are up and preflight passed.",
    "phase_started": "(phase: str, duration_s: float) at each phase edge.",
    "fault_applied": "(record: FaultRecord) after a fault is in place, with its read-back.",
    "fault_reverted": "(record: FaultRecord) after a fault is undone (or failed to be).",
    "run_finished": "(result: RunResult) after verdicts are computed, before reports are written.",
    "message": "(text: str) a line for humans: starting parts, waiting, reverting...",
}


class Events:
    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {name: [] for name in EVENTS}

    def on(self, name: str, handler: Handler) -> None:
        if name not in self._handlers:
            raise KeyError(f"unknown event {name!r}; known: {', '.join(EVENTS)}")
        self._handlers[name].append(handler)

    def emit(self, name: str, *args: Any) -> None:
        for handler in self._handlers[name]:
            handler(*args)
