"""A running log of the run for people watching a terminal (game days, CI logs).

A fault's line when applied says what was set, in the scenario's units, and how long it took
(the read-back is in the reports); its line when reverted says what the system read back as
``key=value`` pairs, every key kept (the proxy's counters included), one line each, never
wrapped by us: a CI log keeps them whole and a terminal wraps them at its own edge.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from streamquake.run.events import (
    Events,
    FaultApplied,
    FaultReverted,
    HeldByHand,
    Message,
    PhaseStarted,
    RunFinished,
    RunStarted,
    Tick,
)
from streamquake.run.watch import LATENCIES, LIVE_WINDOW_S

if TYPE_CHECKING:
    from streamquake.run.watch import RollingStats
    from streamquake.scenario import Scenario, SLOSpec
    from streamquake.scenario.steps import StepSpec
from streamquake.reports.phrasing import flat, value_text


def attach_live_log(events: Events, console: Console) -> None:
    """Each line stamped in the reports' time base: seconds since the first phase began
    (negative while the parts start; the lines before the run is planned carry no stamp)."""
    t0: list[float] = []                # the first phase's start (epoch s), from RunStarted
    steps: dict[str, StepSpec] = {}     # the steps form's timeline, from RunStarted

    def say(text: str) -> None:
        stamp = f"{time.time() - t0[0]:+7.1f}s" if t0 else " " * 8
        console.print(f"[dim]{stamp}[/] {text}", highlight=False, soft_wrap=True)

    def on_message(event: Message) -> None:
        say(escape(event.text))

    def on_started(event: RunStarted) -> None:
        t0.append(event.starts_at)
        say(f"the first phase begins in {max(0.0, event.starts_at - time.time()):.1f} s: these "
            "times count from it, as the reports' do")
        if event.scenario.steps is not None:
            steps.update((s.name, s) for s in event.scenario.timeline)

    def on_phase(event: PhaseStarted) -> None:
        step = steps.get(event.phase)
        if step is None:
            say(f"[bold]phase {event.phase}[/] ({event.duration_s:g} s)")
            return
        faults = f"; faults {', '.join(step.faults)}" if step.faults else ""
        say(f"[bold]step {escape(step.name)}[/] ({step.kind}, {event.duration_s:g} s"
            f"{escape(faults)})")

    def on_applied(event: FaultApplied) -> None:
        record = event.record      # its read-back stays in the reports (report.json)
        took = f", in place in {record.apply_ms:.0f} ms" if record.apply_ms is not None else ""
        say(f"[yellow]fault applied[/] {escape(record.name)} ({record.type}): "
            f"{escape(record.settings)}{took}")

    def on_reverted(event: FaultReverted) -> None:
        record = event.record
        # Its settings as the scenario wrote them (``drop=15%``), not the proxy's own echo of
        # them in its units (``fault.drop=0.15``); then what it read back on the revert.
        what = f"[red]{escape(record.error)}[/]" if record.error else escape(" ".join(
            f"{k}={v}" for k, v in flat(record.reverted)
            if k != "name" and not k.startswith("fault.")))
        settings = f" ({escape(record.settings)})" if record.settings else ""
        say(f"[green]fault reverted[/] {escape(record.name)}{settings}: {what}")

    events.on(Message, on_message)
    events.on(RunStarted, on_started)
    events.on(PhaseStarted, on_phase)
    events.on(FaultApplied, on_applied)
    events.on(FaultReverted, on_reverted)


class LiveView:
    """While phases run: the phase and its countdown, the active faults, rolling p50/p95 of
    TTFB, TTFT, ITL and E2E over the last seconds (with the count behind each), requests/s,
    errors, and a light per SLO on that window. A rich Live panel on a terminal; a plain line
    every ``line_every_s`` seconds otherwise (a CI log)."""

    def __init__(self, console: Console, scenario: Scenario, line_every_s: float = 5.0) -> None:
        self.console = console
        self.slos = list(scenario.slos)
        self.line_every_s = line_every_s
        self.phase: str | None = None
        self.phase_end = 0.0            # before the first phase: when it begins
        self.first = scenario.timeline[0].name
        # The steps form names each step with its kind and the one after it.
        self.steps = list(scenario.timeline) if scenario.steps is not None else []
        self.faults: dict[str, str] = {}
        self.by_hand: tuple[str, ...] = ()
        self.stats: RollingStats | None = None
        self._live: Live | None = None
        self._last_line = 0.0

    def attach(self, events: Events) -> None:
        events.on(RunStarted, self._on_started)
        events.on(PhaseStarted, self._on_phase)
        events.on(FaultApplied, self._on_applied)
        events.on(FaultReverted, self._on_reverted)
        events.on(HeldByHand, self._on_by_hand)
        events.on(Tick, self._on_tick)
        events.on(RunFinished, lambda e: self.stop())

    def _on_applied(self, event: FaultApplied) -> None:
        self.faults[event.record.name] = event.record.type

    def _on_by_hand(self, event: HeldByHand) -> None:
        self.by_hand = event.faults

    def _faults(self) -> str:
        """This run's faults in force, and any held here by hand (not by this run)."""
        own = ", ".join(f"{n} ({t})" for n, t in self.faults.items()) or "none"
        return own + (f"; by hand: {', '.join(self.by_hand)}" if self.by_hand else "")

    def _on_reverted(self, event: FaultReverted) -> None:
        self.faults.pop(event.record.name, None)

    def _on_started(self, event: RunStarted) -> None:
        self.phase_end = event.starts_at

    def _on_phase(self, event: PhaseStarted) -> None:
        self.phase, self.phase_end = event.phase, time.time() + event.duration_s
        if self._live is None and self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4,
                              transient=True)
            self._live.start()

    def _on_tick(self, event: Tick) -> None:
        self.stats = event.stats
        if self._live is not None:
            self._live.update(self._render())
        elif time.monotonic() - self._last_line >= self.line_every_s:
            self._last_line = time.monotonic()
            self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _when(self, sep: str = " ") -> str:
        """``phase fault 12 s left``, or before the first phase ``starting, warmup in 3 s``."""
        left = max(0.0, self.phase_end - time.time())
        if self.phase is None:
            return f"starting, {self.first} in {left:.0f} s"
        names = [s.name for s in self.steps]
        if self.phase not in names:
            return f"phase {self.phase}{sep}{left:.0f} s left"
        i = names.index(self.phase)
        then = (f"next {self.steps[i + 1].name} ({self.steps[i + 1].kind})"
                if i + 1 < len(names) else "the last step")
        return f"step {self.phase} ({self.steps[i].kind}){sep}{left:.0f} s left, {then}"

    def _light(self, slo: SLOSpec) -> tuple[str, str]:
        s = self.stats
        value: float | None = None
        if s is not None and slo.metric == "error_rate" and s.requests:
            value = s.errors / s.requests
        elif s is not None and slo.percentile in (50, 95) and slo.metric in s.p50:
            value = (s.p50 if slo.percentile == 50 else s.p95)[slo.metric]
        if value is None:
            return "-", "dim"
        ok = value <= slo.max if slo.max is not None else value >= (slo.min or 0.0)
        return value_text(slo.metric, value), "green" if ok else "red"

    def line(self) -> str:
        s = self.stats
        head = f"live: {self._when()} | faults: {self._faults()}"
        if s is None:
            return head
        lat = " | ".join(
            f"{m.removesuffix('_ms').upper()} p50 {_ms(s.p50[m])} p95 {_ms(s.p95[m])} "
            f"(n={s.counts[m]})" for m in LATENCIES)
        err = f"{s.errors / s.requests:.1%}" if s.requests else "-"
        flying = "-" if s.in_flight is None else str(s.in_flight)
        return (f"{head} | {s.per_s:.1f} req/s | in flight {flying} | errors {err} | {lat} "
                f"(last {s.window_s:.0f} s)")

    def _render(self) -> Table:
        table = Table(title=self._when(" · "), title_justify="left",
                      show_header=True, header_style="bold", box=None)
        table.add_column(f"last {LIVE_WINDOW_S:g} s")
        table.add_column("p50 ms", justify="right")
        table.add_column("p95 ms", justify="right")
        table.add_column("n", justify="right")
        s = self.stats
        for m in LATENCIES:
            if s is None:
                table.add_row(m, "-", "-", "0")
            else:
                table.add_row(m, _ms(s.p50[m]), _ms(s.p95[m]), str(s.counts[m]))
        if s is not None:
            err = f"{s.errors / s.requests:.1%}" if s.requests else "-"
            table.add_row("requests/s", f"{s.per_s:.1f}", "", str(s.requests))
            table.add_row("in flight", "-" if s.in_flight is None else str(s.in_flight), "", "")
            table.add_row("errors", err, "", str(s.errors))
        table.add_row("faults", escape(self._faults()), "", "")
        for slo in self.slos:
            value, style = self._light(slo)
            table.add_row(escape(slo.label), f"[{style}]{value}[/]", "", "")
        return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
