"""``streamquake history``: each scenario's recent runs and its latest run against the runs
before it (history.py: by the variation between runs)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.reports.history import StoredRun, check_latest, stored_phases
from streamquake.reports.phrasing import value_text, when
from streamquake.reports.terminal import print_table

COLUMNS = (("baseline", "ttft_ms", "p95"), ("recovery", "ttft_ms", "p95"),
           ("fault", "ttft_ms", "p95"), ("recovery", "itl_ms", "p95"),
           ("recovery", "e2e_ms", "p95"), ("recovery", "error_rate", "value"))


def print_history(runs: list[StoredRun], console: Console, *, window: int, tolerance: float,
                  last: int, min_runs: int) -> bool:
    """Prints a table per scenario; returns True when a scenario's latest run regressed."""
    if not runs:
        console.print("the history store has no runs yet")
        return False
    regressed = False
    for name in sorted({r.scenario for r in runs}):
        mine = [r for r in runs if r.scenario == name]
        judged = check_latest(mine, window, tolerance, min_runs)
        usual = _step_columns(mine[-1]) if mine[-1].steps else COLUMNS
        # A flagged metric is shown, whether or not it is one of the usual columns.
        columns = [*usual, *(tuple(f.key.rsplit(".", 2)) for f in judged.worse
                             if tuple(f.key.rsplit(".", 2)) not in usual)]
        table = Table(title=f"{name}: last {min(last, len(mine))} of {len(mine)} runs",
                      title_justify="left")
        for col in ("run", "started", "exit", "scenario sha256",
                    *(f"{p} {m} {s if s != 'value' else ''}".strip() for p, m, s in columns)):
            table.add_column(col, justify="right")
        for r in mine[-last:]:
            cells = [value_text(m, r.values.get(f"{p}.{m}.{s}")) for p, m, s in columns]
            table.add_row(str(r.id), when(r.started_at), str(r.exit_code),
                          r.scenario_sha256[:8], *cells)
        print_table(table, console)
        style = "bold red" if judged.worse else "" if judged.not_judged else "green"
        line = escape(judged.summary())
        console.print(f"[{style}]{line}[/]" if style else line, soft_wrap=True, highlight=False)
        for note in judged.notes:
            console.print(f"[yellow]Note[/] {escape(name)} run {judged.latest.id}: "
                          f"{escape(note)}", soft_wrap=True, highlight=False)
        for f in judged.worse:
            console.print(f"[bold red]REGRESSION[/] {escape(name)} run {judged.latest.id}: "
                          f"{escape(f.sentence())}", soft_wrap=True, highlight=False)
        regressed = regressed or bool(judged.worse)
    return regressed


def _step_columns(run: StoredRun) -> tuple[tuple[str, str, str], ...]:
    """A ``steps:`` scenario's usual columns: each step's TTFT p95, in the order of its
    timeline, then the last step's error rate."""
    steps = stored_phases(run)
    return (*((step, "ttft_ms", "p95") for step in steps),
            *((steps[-1], "error_rate", "value") for _ in steps[-1:]))
