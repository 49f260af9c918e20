"""`run --json`: the verdicts as one JSON document on stdout, for scripts that gate on them
(the full result is in report.json)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.reports.phrasing import sentence, skipped_steps, state
from streamquake.result import Check, RunResult


def _where(c: Check) -> str:
    return (c.name + (f" [{c.cls}]" if c.cls else "") + f" in {c.phase}"
            + (f" after {c.judges}" if c.judges else ""))


def verdicts_document(result: RunResult, out: Path) -> JsonDict:
    checks: list[JsonValue] = []
    skipped = skipped_steps(result)
    for c in result.checks:
        checks.append({**asdict(c), "state": state(c), "sentence": sentence(c, skipped)})
    return {
        "schema": "streamquake.verdicts/1",
        "scenario": result.scenario_name,
        "exit_code": result.exit_code,
        "passed": not result.broken and result.interrupted is None and not result.aborted
        and not result.not_judged,
        "interrupted": result.interrupted,
        "aborted": result.aborted,
        "broken": [_where(c) for c in result.broken],
        # Gating timing checks of steps whose load generator was saturated, neither met nor
        # broken (exit 6 when nothing broke); each check's not_judged says why.
        "not_judged": [_where(c) for c in result.not_judged],
        "skipped_steps": [s for s in sorted(skipped)],
        "checks": checks,
        "warnings": list(result.errors),
        "report": str(out / "report.json"),
    }
