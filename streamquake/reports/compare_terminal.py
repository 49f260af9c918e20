"""``streamquake compare`` in a terminal or a CI log."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.reports.compare import Comparison, _signed, _v, floor_for, verdict_text
from streamquake.reports.terminal import print_table

_STYLE = {"worse": "bold red", "better": "green", "same": "", "no data": "dim"}


def print_comparison(c: Comparison, console: Console) -> None:
    console.print(f"A: {escape(str(c.a.path))}\nB: {escape(str(c.b.path))}", highlight=False,
                  soft_wrap=True)
    console.print(f"B - A; {escape(c.method)}; worse/better only when the whole interval lies "
                  f"beyond the margin max({c.tolerance * 100:g}% of A, floor: "
                  f"{floor_for('e2e_ms', c.slack_ms):g} ms, 0.5 points, 1 token/s)",
                  highlight=False, soft_wrap=True)
    if c.differs is not None:
        console.print(f"[bold yellow]Note[/]: {escape(c.differs)}; compared as asked "
                      "(--different-scenarios)", highlight=False, soft_wrap=True)
    for text in c.one_side_text():
        console.print(f"[bold yellow]Note[/]: {escape(text)}", highlight=False, soft_wrap=True)
    for phase in c.phases:
        rows = [r for r in c.rows if r.phase == phase]
        if not rows:
            continue
        table = Table(title=phase, title_justify="left")
        for col in ("metric", "A", "B", "B - A", f"{c.confidence * 100:g}% CI", "n A / B",
                    "verdict"):
            table.add_column(col, justify="left" if col in ("metric", "verdict") else "right")
        for r in rows:
            ci = "-" if r.lo is None else f"{_signed(r.metric, r.lo)} .. {_signed(r.metric, r.hi)}"
            style = _STYLE.get(r.verdict, "")
            verdict = f"[{style}]{verdict_text(r)}[/]" if style else verdict_text(r)
            table.add_row(r.name, _v(r.metric, r.a), _v(r.metric, r.b),
                          _signed(r.metric, r.diff), ci, f"{r.n_a} / {r.n_b}", verdict)
        print_table(table, console)
    if c.worse:
        console.print(f"[bold red]REGRESSION[/]: {len(c.worse)} metric(s) worse: "
                      + ", ".join(f"{r.phase} {r.name}" for r in c.worse), soft_wrap=True)
    else:
        console.print("[green]no regression[/]")
