"""The run's exit code and the scenario as echoed in reports."""

from __future__ import annotations

from streamquake.errors import (
    EXIT_ABORTED,
    EXIT_ENVIRONMENT,
    EXIT_NOT_JUDGED,
    EXIT_OK,
    EXIT_REVERT_FAILED,
    EXIT_SLO_BROKEN,
)
from streamquake.jsontypes import JsonDict
from streamquake.result import RunResult
from streamquake.scenario import Scenario


def exit_code_for(result: RunResult, revert_failed: bool) -> int:
    if revert_failed:
        return EXIT_REVERT_FAILED
    if result.interrupted:
        return 130 if result.interrupted == "SIGINT" else 143
    if result.aborted:
        return EXIT_ABORTED
    if any(f.error for f in result.faults):
        return EXIT_ENVIRONMENT
    if result.broken:
        return EXIT_SLO_BROKEN      # a real break (errors, a judged timing) outranks the rest
    return EXIT_NOT_JUDGED if result.not_judged else EXIT_OK


def redacted_echo(scenario: Scenario) -> JsonDict:
    """The scenario as run, with every header value hidden: they carry credentials."""
    echo: JsonDict = scenario.model_dump(mode="json", by_alias=True)
    target = echo["target"]
    assert isinstance(target, dict)
    headers = target.get("headers") or {}
    assert isinstance(headers, dict)
    target["headers"] = {k: "<redacted>" for k in headers}
    return echo
