"""summary.md: the verdict grid for a CI job summary or a pull-request comment."""

from __future__ import annotations

from pathlib import Path

from streamquake.reports.table import PHASE_COLUMNS, Cell, summary_rows, verdict_rows, verdict_word
from streamquake.result import RunResult


def _md(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if not cell.gating:
        return f"{cell.text} ({'met' if cell.passed else 'broken'}, not gating)"
    return f"{cell.text} ✅" if cell.passed else f"**{cell.text} ❌**"


def write_markdown(result: RunResult, path: Path) -> Path:
    head = "| | " + " | ".join(PHASE_COLUMNS) + " |\n|---|" + "---:|" * len(PHASE_COLUMNS) + "\n"
    lines = [f"## streamquake: {result.scenario_name}: {verdict_word(result)}", "", head.rstrip()]
    lines += [f"| {label} | " + " | ".join(c[p] for p in PHASE_COLUMNS) + " |"
              for label, c in summary_rows(result)]
    lines += ["", "### SLO verdicts", "", head.rstrip()]
    lines += [f"| {label} | " + " | ".join(_md(c.get(p)) for p in PHASE_COLUMNS) + " |"
              for label, c in verdict_rows(result)]
    path.write_text("\n".join(lines) + "\n")
    return path
