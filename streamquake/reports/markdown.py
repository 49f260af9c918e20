"""summary.md: the verdict grid for a CI job summary or a pull-request comment, with when, how
long, against what, which faults with which settings, and how requests failed."""

from __future__ import annotations

from pathlib import Path

from streamquake.reports.table import (
    PHASE_COLUMNS,
    Cell,
    error_rows,
    fmt_value,
    status_row,
    summary_rows,
    top_reasons,
    verdict_rows,
    verdict_word,
)
from streamquake.reports.words import (
    class_reading,
    duration,
    flap_text,
    inconclusive_legend,
    interruption,
    pairs,
    run_t0,
    target_text,
    when,
)
from streamquake.result import FaultRecord, RunResult


def _md(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if not cell.ran:
        return "not run"
    if not cell.gating:
        return f"{cell.text} ({'met' if cell.passed else 'broken'}, not gating)"
    if not cell.measurable and cell.passed:
        return f"{cell.text} ⚠️"
    return f"{cell.text} ✅" if cell.passed else f"**{cell.text} ❌**"


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _at(result: RunResult, t: float | None) -> str:
    return "-" if t is None else f"+{t - run_t0(result):.1f} s"


def _fault_rows(result: RunResult, fault: FaultRecord) -> str:
    state = f"**{_esc(fault.error)}**" if fault.error else "applied and reverted"
    if (flapped := flap_text(fault)) is not None:
        state += f"; {_esc(flapped)}"
    return (f"| {_esc(fault.name)} | {fault.type} | {fault.phase} | "
            f"`{_esc(pairs(fault.configured, skip=('type', 'name', 'phase')))}` | "
            f"{_at(result, fault.applied_at)} | {_at(result, fault.reverted_at)} | "
            f"`{_esc(pairs(fault.reverted))}` | {state} |")


def render_markdown(result: RunResult) -> str:
    head = "| | " + " | ".join(PHASE_COLUMNS) + " |\n|---|" + "---:|" * len(PHASE_COLUMNS)
    env = result.environment
    lines = [f"## streamquake: {result.scenario_name}: {verdict_word(result)}", ""]
    lines.append(
        f"{when(result.started_at)}, {duration(result.finished_at - result.started_at)}, "
        f"exit code {result.exit_code}; {_esc(target_text(result) or 'no target started')}; "
        f"scenario `{_esc(result.scenario_file)}` (sha256 `{env.get('scenario_sha256', '-')}`), "
        f"streamquake {result.tool_version} on `{env.get('host', '-')}`")
    stopped = interruption(result)
    if stopped:
        lines += ["", f"> **{_esc(stopped)}**"]
    if result.phases:
        status = status_row(result)
        lines += ["", "### Measured per phase", "", head,
                  "| phase | " + " | ".join(status[p] for p in PHASE_COLUMNS) + " |"]
        lines += [f"| {label} | " + " | ".join(c[p] for p in PHASE_COLUMNS) + " |"
                  for label, c in summary_rows(result)]
        errors = error_rows(result)
        lines += ["", "### Failed requests by kind", ""]
        if errors:
            lines += [head] + [f"| {kind} | " + " | ".join(c[p] for p in PHASE_COLUMNS) + " |"
                               for kind, c in errors]
            lines += ["", "Why, most frequent first:", ""]
            lines += [f"- {_esc(reason)}" for reason in top_reasons(result)]
        else:
            lines.append("No request failed in any phase.")
    lines += _slow_consumers(result, head)
    if result.checks:
        lines += ["", "### SLO verdicts", "", head]
        lines += [f"| {_esc(label)} | " + " | ".join(_md(c.get(p)) for p in PHASE_COLUMNS) + " |"
                  for label, c in verdict_rows(result)]
        legend = inconclusive_legend(result.checks)
        if legend:
            lines += ["", _esc(legend)]
    if result.faults:
        lines += ["", "### Faults", "",
                  "| fault | type | phase | settings | applied | reverted | read back at revert "
                  "| state |", "|---|---|---|---|---:|---:|---|---|"]
        lines += [_fault_rows(result, f) for f in result.faults]
    if result.errors:
        lines += ["", "### Warnings and errors", ""] + [f"- {_esc(e)}" for e in result.errors]
    lines += ["", "Full report: `report.html` (charts), `report.json`, `timeline.csv`, "
              "`samples.csv` next to this file."]
    return "\n".join(lines) + "\n"


def _slow_consumers(result: RunResult, head: str) -> list[str]:
    """With a slow-consumer class: each class's TTFT and ITL p95 per phase, the slow one's at
    its own pace and the others' as its backpressure left them."""
    reading = class_reading(result)
    if not reading:
        return []
    names = sorted({c for p in result.phases for c in p.classes})
    lines = ["", "### Per request class (TTFT p95 / ITL p95 ms)", "", head]
    for name in names:
        cells = []
        for phase in PHASE_COLUMNS:
            st = next((p.classes.get(name) for p in result.phases if p.name == phase), None)
            got = [v.get("p95") if isinstance(v := (st or {}).get(m), dict) else None
                   for m in ("ttft_ms", "itl_ms")]
            cells.append(" / ".join(fmt_value("ttft_ms", x if isinstance(x, int | float)
                                              else None) for x in got))
        how = f" ({_esc(reading[name])})" if name in reading else ""
        lines.append(f"| {_esc(name)}{how} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(result: RunResult, path: Path) -> Path:
    path.write_text(render_markdown(result))
    return path
