"""The rich verdict table printed at the end of a run."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.reports.table import PHASE_COLUMNS, Cell, summary_rows, verdict_rows, verdict_word
from streamquake.result import RunResult


def _render(cell: Cell | None) -> str:
    if cell is None:
        return "[dim]-[/]"
    if not cell.gating:
        mark = "met" if cell.passed else "broken"
        return f"[dim]{cell.text} ({mark}, not gating)[/]"
    return f"[green]{cell.text} ✓[/]" if cell.passed else f"[bold red]{cell.text} ✗[/]"


def print_result(result: RunResult, console: Console) -> None:
    summary = Table(title=f"{result.scenario_name}: measured per phase", title_justify="left")
    summary.add_column("metric")
    for phase in PHASE_COLUMNS:
        summary.add_column(phase, justify="right")
    for label, cells in summary_rows(result):
        summary.add_row(escape(label), *(cells[p] for p in PHASE_COLUMNS))
    console.print(summary)

    verdicts = Table(title="SLO verdicts", title_justify="left")
    verdicts.add_column("check")
    for phase in PHASE_COLUMNS:
        verdicts.add_column(phase, justify="right")
    for label, verdict_cells in verdict_rows(result):
        verdicts.add_row(escape(label), *(_render(verdict_cells.get(p)) for p in PHASE_COLUMNS))
    console.print(verdicts)

    for fault in result.faults:
        state = f"[red]{escape(fault.error)}[/]" if fault.error else "applied and reverted"
        console.print(f"fault [bold]{escape(fault.name)}[/] ({fault.type}, {fault.phase}): {state}")
    for err in result.errors:
        console.print(f"[yellow]warning:[/] {escape(err)}")
    word = verdict_word(result)
    style = "green" if word == "ALL SLOs MET" else "bold red"
    console.print(f"[{style}]{word}[/]")
