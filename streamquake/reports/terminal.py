"""The rich verdict table printed at the end of a run.

In a CI log (stdout not a terminal) rich would wrap at 80 columns; every table is printed at its
own natural width there instead, so no cell is ever wrapped mid-value.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.reports.phrasing import (
    NOT_GATING_LEGEND,
    flap_text,
    inconclusive_legend,
    interruption,
    not_judged_legend,
    recovery_basis,
    recovery_time_lines,
)
from streamquake.reports.table import (
    PHASE_COLUMNS,
    ROLES,
    Cell,
    FaultBlock,
    error_rows,
    fault_blocks,
    status_row,
    step_fault_records,
    step_rows,
    summary_rows,
    top_reasons,
    unblocked_checks,
    verdict_rows,
    verdict_tone,
    verdict_word,
)
from streamquake.result import Check, FaultRecord, RunResult


def _render(cell: Cell | None, compact: bool = False) -> str:
    if cell is None:
        return "[dim]-[/]"
    if not cell.ran:
        return "[dim]not run[/]"
    if cell.not_judged:     # not_judged_legend says why and how it gates
        if not cell.passed:
            return f"[bold red]{cell.text} ✗[/]"
        return f"[dim]({cell.text})[/]" if not cell.gating else f"[yellow]{cell.text} ~[/]"
    if not cell.gating and compact:     # NOT_GATING_LEGEND says what the brackets mean
        return f"[dim]({cell.text} {'✓' if cell.passed else '✗'})[/]"
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
    if result.steps_form:
        _print_steps(result, console)
    else:
        _print_phases(result, console)
    if result.phases:   # a run that never started printed its errors already
        for err in result.errors:
            console.print(f"[yellow]warning:[/] {escape(err)}", soft_wrap=True)
    stopped = interruption(result)
    if stopped:
        console.print(f"[yellow]{escape(stopped)}[/]", soft_wrap=True)
    style = {"ok": "green", "warn": "bold yellow"}.get(verdict_tone(result), "bold red")
    console.print(f"[{style}]{escape(verdict_word(result))}[/]", soft_wrap=True)


def _print_phases(result: RunResult, console: Console) -> None:
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
    for legend in (inconclusive_legend(result.checks), not_judged_legend(result.checks)):
        if legend:
            console.print(legend, markup=False, highlight=False, emoji=False, soft_wrap=True)
    for line in recovery_time_lines(result):
        console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)

    for fault in result.faults:
        _print_fault(fault, console, f"{fault.type}, {fault.phase}", soft_wrap=True)


def _print_fault(fault: FaultRecord, console: Console, about: str, soft_wrap: bool) -> None:
    state = f"[red]{escape(fault.error)}[/]" if fault.error else "applied and reverted"
    console.print(f"fault [bold]{escape(fault.name)}[/] ({about}): {state}", soft_wrap=soft_wrap)
    if (flapped := flap_text(fault)) is not None:
        console.print(f"  {escape(flapped)}", soft_wrap=soft_wrap)


def _print_steps(result: RunResult, console: Console) -> None:
    """The steps form: the timeline, then a block per fault step (before / during / after),
    each narrow enough for 80 columns (cells break between words, values never)."""
    if result.phases:
        overview = Table(title=f"{result.scenario_name}: the timeline", title_justify="left")
        for name in ("step", "kind", "faults", "length", "status", "sent", "SLOs"):
            overview.add_column(name, overflow="fold",
                                justify="right" if name in ("length", "sent") else "left")
        for row in step_rows(result):
            overview.add_row(*(escape(x) for x in row))
        console.print(overview)
        for reason in top_reasons(result):
            console.print(f"failed: {reason}", markup=False, highlight=False)
    blocks = fault_blocks(result)
    for block in blocks:
        _print_block(result, block, console)
    rest = unblocked_checks(result, blocks)
    if rest:
        others = Table(title="SLO verdicts in the other steps", title_justify="left")
        others.add_column("check", overflow="fold")
        others.add_column("step", overflow="fold")
        others.add_column("verdict", justify="right", no_wrap=True)
        for label, cells in verdict_rows(result, rest):
            for step, cell in cells.items():
                others.add_row(escape(label), escape(step), _render(cell, compact=True))
        console.print(others)
        _legends(rest, console)
    in_steps = {f.name for p in result.phases for f in step_fault_records(result, p.name)}
    for fault in result.faults:
        if fault.name not in in_steps:     # whole-run ones, and any the steps do not name
            _print_fault(fault, console, f"{fault.type}, {fault.phase}", soft_wrap=False)


def _print_block(result: RunResult, block: FaultBlock, console: Console) -> None:
    console.print()
    console.print(f"[bold]{escape(block.title)}[/]")
    if status_row(result, block.columns)[block.step] == "skipped":
        console.print("skipped: the run aborted before this step, so its faults were not "
                      "applied and its checks were not run")
    measured = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    measured.add_column("measured", overflow="fold")
    for role in ROLES:
        measured.add_column(role, justify="right", no_wrap=True)
    status = status_row(result, block.columns)
    measured.add_row("step", *(status[c] for c in block.columns))
    for label, cells in summary_rows(result, block.columns):
        measured.add_row(escape(label), *(cells[c] for c in block.columns))
    for kind, cells in error_rows(result, block.columns):
        measured.add_row(escape(f"  {kind} errors"), *(cells[c] for c in block.columns))
    console.print(measured)
    if block.checks:
        verdicts = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        verdicts.add_column("verdicts", overflow="fold")
        for role in ROLES:
            verdicts.add_column(role, justify="right", no_wrap=True)
        for label, vcells in verdict_rows(result, block.checks):
            verdicts.add_row(escape(label), *(_render(vcells.get(c), compact=True) if c
                                              else "[dim]-[/]" for c in block.columns))
        console.print(verdicts)
        _legends(block.checks, console)
    for line in recovery_time_lines(result, block.step):
        console.print(line, markup=False, highlight=False, emoji=False)
    for fault in step_fault_records(result, block.step):
        _print_fault(fault, console, fault.type, soft_wrap=False)


def _legends(checks: list[Check], console: Console) -> None:
    """Under a grid of compact cells: what brackets and ``?`` mean, and the recovery checks'
    baselines with their counts and intervals; wrapped at the console's width."""
    said = [NOT_GATING_LEGEND] if any(c.ran and not c.gating and not c.not_judged
                                      for c in checks) else []
    said += [legend] if (legend := inconclusive_legend(checks)) else []
    said += [legend] if (legend := not_judged_legend(checks)) else []
    said += [basis for c in checks if (basis := recovery_basis(c))]
    for text in said:
        console.print(text, markup=False, highlight=False, emoji=False)
