"""A running log of the run for people watching a terminal (game days, CI logs)."""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.markup import escape

from streamquake.events import Events, FaultApplied, FaultReverted, Message, PhaseStarted


def _short(data: object, limit: int = 160) -> str:
    text = json.dumps(data, separators=(",", ":"), default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def attach_live_log(events: Events, console: Console) -> None:
    t_start = time.monotonic()

    def stamp() -> str:
        return f"[dim]{time.monotonic() - t_start:6.1f}s[/]"

    def on_message(event: Message) -> None:
        console.print(f"{stamp()} {escape(event.text)}", highlight=False)

    def on_phase(event: PhaseStarted) -> None:
        console.print(f"{stamp()} [bold]phase {event.phase}[/] ({event.duration_s:g} s)",
                      highlight=False)

    def on_applied(event: FaultApplied) -> None:
        record = event.record
        console.print(f"{stamp()} [yellow]fault applied[/] {escape(record.name)} ({record.type}): "
                      f"{escape(_short(record.applied))}", highlight=False)

    def on_reverted(event: FaultReverted) -> None:
        record = event.record
        what = record.error or _short(record.reverted)
        state = f"[red]{escape(what)}[/]" if record.error else escape(what)
        console.print(f"{stamp()} [green]fault reverted[/] {escape(record.name)}: {state}",
                      highlight=False)

    events.on(Message, on_message)
    events.on(PhaseStarted, on_phase)
    events.on(FaultApplied, on_applied)
    events.on(FaultReverted, on_reverted)
