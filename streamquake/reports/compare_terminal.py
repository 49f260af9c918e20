"""``streamquake compare`` in a terminal or a CI log."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamquake.reports.compare import (
    Comparison,
    cells,
    columns,
    headline,
    rule_text,
    verdict_text,
)
from streamquake.reports.terminal import print_table

_STYLE = {"worse": "bold red", "better": "green", "same": "", "no data": "dim",
          "not judged": "yellow"}


def _say(console: Console, text: str) -> None:
    console.print(text, highlight=False, soft_wrap=True)


def print_comparison(c: Comparison, console: Console) -> None:
    for side, runs in (("A", c.a_runs or [c.a]), ("B", c.b_runs or [c.b])):
        _say(console, f"{side}: " + escape(", ".join(str(r.path) for r in runs)))
    _say(console, escape(rule_text(c)))
    if c.differs is not None:
        _say(console, f"[bold yellow]Note[/]: {escape(c.differs)}; compared as asked "
             "(--different-scenarios)")
    for text in [*c.one_side_text(), *c.notes]:
        _say(console, f"[bold yellow]Note[/]: {escape(text)}")
    for phase in c.phases:
        rows = [r for r in c.rows if r.phase == phase]
        if not rows:
            continue
        table = Table(title=phase, title_justify="left")
        for col in columns(c):
            table.add_column(col, justify="left" if col in ("metric", "verdict") else "right")
        for r in rows:
            style = _STYLE.get(r.verdict, "")
            verdict = f"[{style}]{verdict_text(r)}[/]" if style else verdict_text(r)
            table.add_row(*cells(c, r), verdict)
        print_table(table, console)
    line = escape(headline(c))
    style = "bold red" if c.worse else "yellow" if c.not_judged else "green"
    _say(console, f"[{style}]{line}[/]")
