"""The result of a run that never measured anything (bad scenario, failed preflight, target
unreachable), so junit.xml and summary.md exist on every exit path and a CI test-report step
always has something to show: the error, and every SLO as "not run"."""

from __future__ import annotations

import time
from pathlib import Path

from streamquake.errors import StreamquakeError
from streamquake.loadgen.metrics import Stats
from streamquake.result import RunResult
from streamquake.run.outcome import redacted_echo
from streamquake.run.series import environment
from streamquake.run.verdicts import evaluate
from streamquake.scenario import Scenario
from streamquake.version import __version__


def failed_result(scenario_file: Path, scenario: Scenario | None, exc: StreamquakeError,
                  started_at: float) -> RunResult:
    problems = getattr(exc, "problems", None) or [str(exc)]
    echo = redacted_echo(scenario) if scenario is not None else {}
    checks = []
    if scenario is not None:
        phases: dict[str, Stats] = {s.name: Stats() for s in scenario.timeline
                                    if s.kind != "warmup"}
        classes: dict[str, dict[str, Stats]] = {
            p: {rc.name: Stats() for rc in scenario.load.classes} for p in phases}
        checks = evaluate(scenario, phases, classes)
        for check in checks:
            check.ran = False
            check.passed = False
    return RunResult(
        scenario_name=scenario.name if scenario is not None else scenario_file.stem,
        scenario_file=str(scenario_file),
        scenario_echo=echo,
        tool_version=__version__,
        started_at=started_at,
        finished_at=time.time(),
        interrupted=None,
        phases=[],
        checks=checks,
        faults=[],
        target={},
        errors=[str(p) for p in problems],
        exit_code=exc.exit_code,
        failure="; ".join(str(p) for p in problems),
        environment=environment(echo),
    )
