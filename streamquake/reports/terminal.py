"""The rich verdict table printed at the end of a run.

In a CI log (stdout not a terminal) rich would wrap at 80 columns; every table is printed at its
own natural width there instead, so no cell is ever wrapped mid-value.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.reports.table import (
    PHASE_COLUMNS,
    Cell,
    error_rows,
    status_row,
    summary_rows,
    top_reasons,
    verdict_rows,
    verdict_word,
)
from streamquake.reports.words import flap_text, inconclusive_legend, interruption
from streamquake.result import RunResult


def _render(cell: Cell | None) -> str:
    if cell is None:
        return "[dim]-[/]"
    if not cell.ran:
        return "[dim]not run[/]"
    if not cell.gating:
        mark = "met" if cell.passed else "broken"
        return f"[dim]{cell.text} ({mark}, not gating)[/]"
    if not cell.measurable and cell.passed:
        return f"[yellow]{cell.text} ![/]"
    return f"[green]{cell.text} ✓[/]" if cell.passed else f"[bold red]{cell.text} ✗[/]"


def print_table(table: Table, console: Console) -> None:
    """Print ``table`` unwrapped when the output is not a terminal (a CI log, a file)."""
    if console.is_terminal:
        console.print(table)
        return
    width = console.measure(table, options=console.options.update_width(10_000)).maximum
    if width <= console.width:
        console.print(table)
        return
    # Console.print never goes wider than the console: a console as wide as the table, same file.
    Console(file=console.file, width=width, no_color=console.no_color, color_system=None,
            highlight=False).print(table)


def print_result(result: RunResult, console: Console) -> None:
    summary = Table(title=f"{result.scenario_name}: measured per phase", title_justify="left")
    summary.add_column("metric")
    for phase in PHASE_COLUMNS:
        summary.add_column(phase, justify="right")
    if result.phases:
        status = status_row(result)
        summary.add_row("phase", *(status[p] for p in PHASE_COLUMNS))
        for label, cells in summary_rows(result):
            summary.add_row(escape(label), *(cells[p] for p in PHASE_COLUMNS))
        for kind, cells in error_rows(result):
            summary.add_row(escape(f"  {kind} errors"), *(cells[p] for p in PHASE_COLUMNS))
        print_table(summary, console)
        for reason in top_reasons(result):
            console.print(f"failed: {reason}", markup=False, highlight=False, soft_wrap=True)

    verdicts = Table(title="SLO verdicts", title_justify="left")
    verdicts.add_column("check")
    for phase in PHASE_COLUMNS:
        verdicts.add_column(phase, justify="right")
    for label, verdict_cells in verdict_rows(result):
        verdicts.add_row(escape(label), *(_render(verdict_cells.get(p)) for p in PHASE_COLUMNS))
    print_table(verdicts, console)
    legend = inconclusive_legend(result.checks)
    if legend:
        console.print(legend, markup=False, highlight=False, emoji=False, soft_wrap=True)

    for fault in result.faults:
        state = f"[red]{escape(fault.error)}[/]" if fault.error else "applied and reverted"
        console.print(f"fault [bold]{escape(fault.name)}[/] ({fault.type}, {fault.phase}): {state}",
                      soft_wrap=True)
        if (flapped := flap_text(fault)) is not None:
            console.print(f"  {escape(flapped)}", soft_wrap=True)
    if result.phases:   # a run that never started printed its errors already
        for err in result.errors:
            console.print(f"[yellow]warning:[/] {escape(err)}", soft_wrap=True)
    stopped = interruption(result)
    if stopped:
        console.print(f"[yellow]{escape(stopped)}[/]", soft_wrap=True)
    word = verdict_word(result)
    style = "green" if word == "ALL SLOs MET" else "bold red"
    console.print(f"[{style}]{word}[/]")
