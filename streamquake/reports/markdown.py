"""summary.md: the verdict grid for a CI job summary or a pull-request comment, with when, how
long, against what, which faults with which settings, and how requests failed."""

from __future__ import annotations

from pathlib import Path

from streamquake.reports.phrasing import (
    class_reading,
    duration,
    flap_text,
    inconclusive_legend,
    interruption,
    not_judged_legend,
    pairs,
    recovery_basis,
    recovery_time_lines,
    run_t0,
    target_text,
    when,
)
from streamquake.reports.table import (
    PHASE_COLUMNS,
    ROLES,
    Cell,
    error_rows,
    fault_blocks,
    fault_settings,
    fmt_value,
    record_step,
    status_row,
    step_fault_records,
    step_rows,
    summary_rows,
    top_reasons,
    unblocked_checks,
    verdict_rows,
    verdict_word,
)
from streamquake.result import Check, FaultRecord, RunResult


def _md(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if not cell.ran:
        return "not run"
    if cell.not_judged:     # not_judged_legend, under the grid, says why and how it gates
        if not cell.passed:
            return f"**{cell.text} ❌**"
        return f"{cell.text} (not gating)" if not cell.gating else f"{cell.text} ⏸️"
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
    step = record_step(result, fault) if result.steps_form else fault.phase
    return (f"| {_esc(fault.name)} | {fault.type} | {step} | "
            f"`{_esc(fault_settings(fault))}` | "
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
    # The verdicts first: a CI reader looks for them, then for what stands behind them.
    if result.checks and not result.steps_form:
        lines += ["", "### SLO verdicts", "", head]
        lines += [f"| {_esc(label)} | " + " | ".join(_md(c.get(p)) for p in PHASE_COLUMNS) + " |"
                  for label, c in verdict_rows(result)]
        for legend in (inconclusive_legend(result.checks), not_judged_legend(result.checks)):
            if legend:
                lines += ["", _esc(legend)]
        if times := recovery_time_lines(result):
            lines += [""] + [f"- {_esc(line)}" for line in times]
    if result.steps_form:
        lines += _steps_sections(result)
    elif result.phases:
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
    lines += _slow_consumers(result, head, PHASE_COLUMNS if not result.steps_form else tuple(
        p.name for p in result.phases if p.kind != "warmup"))
    if result.faults:
        lines += ["", "### Faults", "",
                  f"| fault | type | {'step' if result.steps_form else 'phase'} | settings | "
                  "applied | reverted | read back at revert "
                  "| state |", "|---|---|---|---|---:|---:|---|---|"]
        lines += [_fault_rows(result, f) for f in result.faults]
    if result.errors:
        lines += ["", "### Warnings and errors", ""] + [f"- {_esc(e)}" for e in result.errors]
    lines += ["", "Full report: `report.html` (charts), `report.json`, `timeline.csv`, "
              "`samples.csv` next to this file."]
    return "\n".join(lines) + "\n"


def _steps_sections(result: RunResult) -> list[str]:
    """The steps form: the timeline, then per fault step its before / during / after."""
    lines = ["", "### Timeline", "", "| step | kind | faults | length | status | requests sent "
             "| SLOs |", "|---|---|---|---:|---|---:|---|"]
    lines += ["| " + " | ".join(_esc(x) for x in row) + " |" for row in step_rows(result)]
    if reasons := top_reasons(result):
        lines += ["", "Why requests failed, most frequent first:", ""]
        lines += [f"- {_esc(reason)}" for reason in reasons]
    blocks = fault_blocks(result)
    for b in blocks:
        lines += ["", f"### {_esc(b.title)}", ""]
        if status_row(result, b.columns)[b.step] == "skipped":
            lines += ["Skipped: the run aborted before this step, so its faults were not "
                      "applied and its checks were not run.", ""]
        head = "| | " + " | ".join(f"{r} `{c or '-'}`" for r, c in zip(ROLES, b.columns,
                                                                       strict=True))
        lines += [head + " |", "|---|" + "---:|" * len(ROLES)]
        status = status_row(result, b.columns)
        rows = [("step", status), *summary_rows(result, b.columns),
                *((f"{kind} errors", c) for kind, c in error_rows(result, b.columns))]
        lines += [f"| {_esc(label)} | " + " | ".join(c[k] for k in b.columns) + " |"
                  for label, c in rows]
        if b.checks:
            lines += ["", "| verdicts | " + " | ".join(ROLES) + " |",
                      "|---|" + "---:|" * len(ROLES)]
            lines += [f"| {_esc(label)} | " + " | ".join(_md(c.get(k)) if k else "-"
                                                         for k in b.columns) + " |"
                      for label, c in verdict_rows(result, b.checks)]
            lines += _notes(b.checks)
        if times := recovery_time_lines(result, b.step):
            lines += [""] + [f"- {_esc(line)}" for line in times]
        applied = step_fault_records(result, b.step)
        if applied:
            lines += [""] + [f"- fault {_esc(f.name)} ({f.type}): "
                             f"`{_esc(fault_settings(f))}`, "
                             + (f"**{_esc(f.error)}**" if f.error else "applied and reverted")
                             for f in applied]
    rest = unblocked_checks(result, blocks)
    if rest:
        lines += ["", "### SLO verdicts in the other steps", "", "| check | step | verdict |",
                  "|---|---|---:|"]
        lines += [f"| {_esc(label)} | {_esc(step)} | {_md(cell)} |"
                  for label, cells in verdict_rows(result, rest) for step, cell in cells.items()]
        lines += _notes(rest)
    return lines


def _notes(checks: list[Check]) -> list[str]:
    """Under a verdict table: what ``?`` means, and the recovery checks' baselines with their
    counts and intervals."""
    said = [legend] if (legend := inconclusive_legend(checks)) else []
    said += [legend] if (legend := not_judged_legend(checks)) else []
    said += [basis for c in checks if (basis := recovery_basis(c))]
    return [line for text in said for line in ("", _esc(text))]


def _slow_consumers(result: RunResult, head: str, columns: tuple[str, ...]) -> list[str]:
    """With a slow-consumer class: each class's TTFT and ITL p95 per phase, the slow one's at
    its own pace and the others' as its backpressure left them."""
    reading = class_reading(result)
    if not reading:
        return []
    names = sorted({c for p in result.phases for c in p.classes})
    if columns != PHASE_COLUMNS:
        head = "| | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns)
    lines = ["", "### Per request class (TTFT p95 / ITL p95 ms)", "", head]
    for name in names:
        cells = []
        for phase in columns:
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
