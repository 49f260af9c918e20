"""The verdict grid and phase summary as plain rows, shared by the terminal and Markdown."""

from __future__ import annotations

from dataclasses import dataclass

from streamquake.jsontypes import JsonDict
from streamquake.result import Check, RunResult

PHASE_COLUMNS = ("baseline", "fault", "recovery")
SUMMARY_METRICS = (
    ("requests", "requests", None),
    ("straddling, not scored", "straddled", None),
    ("errors", "error_rate", None),
    ("TTFB p95 ms", "ttfb_ms", "p95"),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p95 ms", "ttft_ms", "p95"),
    ("ITL p50 ms", "itl_ms", "p50"),
    ("ITL p95 ms", "itl_ms", "p95"),
    ("E2E p95 ms", "e2e_ms", "p95"),
    ("tokens/s p50", "output_tokens_per_s", "p50"),
    ("stall rate", "stall_rate", None),
    ("chunk loss", "chunk_loss", None),
)


@dataclass
class Cell:
    text: str
    passed: bool | None      # None: not evaluated here
    gating: bool
    ran: bool = True         # False: the phase never ran ("not run", never a failure)


def fmt_value(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric in ("error_rate", "stall_rate", "chunk_loss"):
        return f"{value * 100:.1f}%"
    if metric in ("requests", "straddled"):
        return f"{int(value)}"
    return f"{value:.1f}"


def verdict_rows(result: RunResult) -> list[tuple[str, dict[str, Cell]]]:
    rows: dict[str, dict[str, Cell]] = {}
    for check in result.checks:
        label = check.name + (f" [{check.cls}]" if check.cls else "")
        rows.setdefault(label, {})[check.phase] = _cell(check)
    return list(rows.items())


def _cell(check: Check) -> Cell:
    if not check.ran:
        return Cell(text="not run", passed=None, gating=check.gating, ran=False)
    # "?": the confidence interval reaches both sides of the limit (see the sentence's CI).
    mark = "?" if check.inconclusive else ""
    return Cell(text=fmt_value(check.metric, check.observed) + mark, passed=check.passed,
                gating=check.gating)


def summary_rows(result: RunResult) -> list[tuple[str, dict[str, str]]]:
    by_phase = {p.name: p.stats for p in result.phases}
    rows = []
    for label, metric, stat in SUMMARY_METRICS:
        cells = {}
        for phase in PHASE_COLUMNS:
            stats: JsonDict = by_phase.get(phase, {})
            value = stats.get(metric)
            if stat is not None:
                value = value.get(stat) if isinstance(value, dict) else None
            cells[phase] = fmt_value(metric, value if isinstance(value, int | float) else None)
        rows.append((label, cells))
    return rows


def status_row(result: RunResult) -> dict[str, str]:
    """Each phase: complete, partial (the run stopped in it), not run, or "-" (not planned)."""
    by_phase = {p.name: p for p in result.phases}
    return {p: by_phase[p].status if p in by_phase else "-" for p in PHASE_COLUMNS}


def error_rows(result: RunResult) -> list[tuple[str, dict[str, str]]]:
    """Failed requests by kind and phase (kinds with no failure anywhere are left out)."""
    counts: dict[str, dict[str, int]] = {}
    for phase in result.phases:
        errors = phase.stats.get("errors")
        if isinstance(errors, dict):
            for kind, n in errors.items():
                if isinstance(n, int) and n > 0:
                    counts.setdefault(kind, {})[phase.name] = n
    status = status_row(result)
    return [(kind, {p: "-" if status[p] in ("-", "not run") else str(c.get(p, 0))
                    for p in PHASE_COLUMNS}) for kind, c in counts.items()]


def verdict_word(result: RunResult) -> str:
    if result.interrupted:
        return f"INTERRUPTED ({result.interrupted})"
    if result.failure or result.exit_code not in (0, 1):
        return f"RUN FAILED (exit {result.exit_code})"
    return "SLO BROKEN" if result.broken else "ALL SLOs MET"
