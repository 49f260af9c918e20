"""``streamquake history``: each scenario's recent runs and its latest run against the rolling
baseline."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.history import StoredRun, check_latest
from streamquake.reports.terminal import print_table
from streamquake.reports.words import value_text, when

COLUMNS = (("baseline", "ttft_ms", "p95"), ("recovery", "ttft_ms", "p95"),
           ("fault", "ttft_ms", "p95"), ("recovery", "itl_ms", "p95"),
           ("recovery", "e2e_ms", "p95"), ("recovery", "error_rate", "value"))


def print_history(runs: list[StoredRun], console: Console, *, window: int, tolerance: float,
                  last: int) -> bool:
    """Prints a table per scenario; returns True when a scenario's latest run regressed."""
    if not runs:
        console.print("the history store has no runs yet")
        return False
    regressed = False
    for name in sorted({r.scenario for r in runs}):
        mine = [r for r in runs if r.scenario == name]
        table = Table(title=f"{name}: last {min(last, len(mine))} of {len(mine)} runs",
                      title_justify="left")
        for col in ("run", "started", "exit", "scenario sha256",
                    *(f"{p} {m} {s if s != 'value' else ''}".strip() for p, m, s in COLUMNS)):
            table.add_column(col, justify="right")
        for r in mine[-last:]:
            cells = [value_text(m, r.values.get(f"{p}.{m}.{s}")) for p, m, s in COLUMNS]
            table.add_row(str(r.id), when(r.started_at), str(r.exit_code),
                          r.scenario_sha256[:8], *cells)
        print_table(table, console)
        flags = check_latest(mine, window, tolerance)
        worse = [f for f in flags if f.regressed]
        if not flags:
            console.print(f"{escape(name)}: no baseline yet (the latest run, and at least one "
                          "earlier run, must have run to the end)", soft_wrap=True)
        elif worse:
            regressed = True
            for f in worse:
                console.print(f"[bold red]REGRESSION[/] {escape(f.sentence(tolerance))}",
                              soft_wrap=True)
        else:
            console.print(f"[green]{escape(name)}: latest run {mine[-1].id} within "
                          f"{tolerance * 100:g}% of the rolling median of its previous "
                          f"{flags[0].baseline_runs} run(s) on every watched metric[/]",
                          soft_wrap=True)
    return regressed
