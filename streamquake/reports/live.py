"""A running log of the run for people watching a terminal (game days, CI logs).

Fault lines say what was set and what the system read back as ``key=value`` pairs, every key
kept (the proxy's counters included), one line each, never wrapped by us: a CI log keeps them
whole and a terminal wraps them at its own edge.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape

from streamquake.events import Events, FaultApplied, FaultReverted, Message, PhaseStarted
from streamquake.reports.words import pairs


def attach_live_log(events: Events, console: Console) -> None:
    t_start = time.monotonic()

    def say(text: str) -> None:
        console.print(f"[dim]{time.monotonic() - t_start:6.1f}s[/] {text}", highlight=False,
                      soft_wrap=True)

    def on_message(event: Message) -> None:
        say(escape(event.text))

    def on_phase(event: PhaseStarted) -> None:
        say(f"[bold]phase {event.phase}[/] ({event.duration_s:g} s)")

    def on_applied(event: FaultApplied) -> None:
        record = event.record
        say(f"[yellow]fault applied[/] {escape(record.name)} ({record.type}): "
            f"{escape(pairs(record.applied))}")

    def on_reverted(event: FaultReverted) -> None:
        record = event.record
        what = f"[red]{escape(record.error)}[/]" if record.error else escape(pairs(record.reverted))
        say(f"[green]fault reverted[/] {escape(record.name)}: {what}")

    events.on(Message, on_message)
    events.on(PhaseStarted, on_phase)
    events.on(FaultApplied, on_applied)
    events.on(FaultReverted, on_reverted)
