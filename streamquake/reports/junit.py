"""junit.xml: one test case per SLO check and phase, so CI systems show each verdict.

Valid against the Jenkins JUnit schema (tests/junit/jenkins-junit.xsd) that GitLab, GitHub test
reporters and Jenkins read. A gating check that broke is a ``failure`` whose message states what
was observed against the limit; a check that does not gate in its phase passes, named "(not
gating)", with the measurement in ``system-out``; a check whose phase never ran is ``skipped``
("not run"), and so is one that cannot be measured against this target when the scenario
lets that pass (``verdicts.unmeasurable``: warn, the default); an interruption, a run that
could not start and a fault that could not be applied or reverted are ``error`` cases. A
timing check that was not judged, its step's load generator being saturated, is ``skipped``
with the guard's reason (a ``failure`` of type ``NotJudged`` under ``verdicts.saturated:
fail``). Each case's time is the duration of the phase it judged.
"""

from __future__ import annotations

import socket
import xml.etree.ElementTree as ET
from pathlib import Path

from streamquake.reports.phrasing import (
    interruption,
    pairs,
    sentence,
    skipped_steps,
    state,
    target_text,
)
from streamquake.reports.table import record_step, step_rows
from streamquake.result import Check, RunResult


def _case(suite: ET.Element, check: Check, scenario: str, seconds: float,
          skipped: frozenset[str]) -> str:
    """Adds the case; returns its outcome: passed, failure or skipped."""
    gating = "" if check.gating else " (not gating)"
    cls = f" [{check.cls}]" if check.cls else ""
    judges = f" after {check.judges}" if check.judges else ""
    case = ET.SubElement(suite, "testcase", classname=f"streamquake.{scenario}.{check.phase}",
                         name=f"{check.name}{cls}{judges}{gating}",
                         time=f"{seconds if check.ran else 0.0:.3f}")
    text = sentence(check, skipped)
    if not check.ran:
        ET.SubElement(case, "skipped").text = text
        return "skipped"
    if (not check.measurable or check.not_judged) and check.passed:
        ET.SubElement(case, "skipped").text = text
        return "skipped"
    if check.gating and not check.passed:
        kind = "NotJudged" if check.not_judged else "NotMeasurable" if not check.measurable \
            else "NoData" if check.observed is None else "SLOBroken"
        failure = ET.SubElement(case, "failure", message=f"SLO broken: {text}", type=kind)
        failure.text = text
        return "failure"
    if not check.gating:
        text = f"not gating in {check.phase} ({state(check)}): {text}"
    ET.SubElement(case, "system-out").text = text
    return "passed"


def _arrival_counts(result: RunResult) -> list[tuple[str, str]]:
    """Open loop: each phase's requests sent and arrivals never sent, so a CI page shows that
    the load asked for was the load applied (the warning in system-err says so too)."""
    out = []
    for p in result.phases:
        sent, unsent = p.stats.get("sent"), p.stats.get("not_sent")
        if isinstance(unsent, int) and unsent > 0:
            out += [(f"{p.name}.requests_sent", str(sent)), (f"{p.name}.not_sent", str(unsent))]
    return out


def _error_case(suite: ET.Element, classname: str, name: str, message: str, kind: str) -> None:
    case = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0.000")
    ET.SubElement(case, "error", message=message, type=kind).text = message


def _client_load(result: RunResult) -> list[tuple[str, str]]:
    """Per phase, whether the load generator kept up, with its figures (run/saturation.py)."""
    return [(f"client_saturated.{p.name}", pairs(p.stats["client"]))
            for p in result.phases if isinstance(p.stats.get("client"), dict)]


def _steps(result: RunResult) -> list[tuple[str, str]]:
    """The steps form: each step in order as a property, so every step shows, judged or not:
    ``step.3.f-slow`` = ``fault, 4 s, faults slow, complete, 16 requests sent``."""
    if not result.steps_form:
        return []
    return [(f"step.{i}.{name}", f"{kind}, {length}, faults {faults}, {status}, {sent} "
             f"requests sent") for i, (name, kind, faults, length, status, sent, _)
            in enumerate(step_rows(result))]


def write_junit(result: RunResult, path: Path) -> Path:
    scenario = result.scenario_name
    durations = {p.name: max(0.0, min(p.end, result.finished_at) - p.start)
                 for p in result.phases}
    suite = ET.Element("testsuite", name=f"streamquake.{scenario}")
    props = ET.SubElement(suite, "properties")
    for name, value in (("scenario_file", result.scenario_file),
                        ("target", target_text(result)),
                        ("exit_code", str(result.exit_code)),
                        *sorted(result.environment.items()),
                        *_steps(result),
                        *_arrival_counts(result),
                        *_client_load(result)):
        ET.SubElement(props, "property", name=name, value=value)
    skipped = skipped_steps(result)
    outcomes = [_case(suite, c, scenario, durations.get(c.phase, 0.0), skipped)
                for c in result.checks]
    errors = 0
    stopped = interruption(result)
    if stopped is not None:
        kind = "Interrupted" if result.interrupted else "RunError"
        name = "run started" if result.failure and not result.phases else "run completed"
        _error_case(suite, f"streamquake.{scenario}", name, stopped, kind)
        errors += 1
    for fault in result.faults:
        if fault.error:
            step = record_step(result, fault) if result.steps_form else fault.phase
            _error_case(suite, f"streamquake.{scenario}.{step}",
                        f"fault {fault.name} ({fault.type}) applied and reverted",
                        fault.error, "FaultError")
            errors += 1
    if result.errors:
        ET.SubElement(suite, "system-err").text = "\n".join(result.errors)
    tests = len(outcomes) + errors
    total = f"{max(0.0, result.finished_at - result.started_at):.3f}"
    suite.attrib.update({
        "tests": str(tests),
        "failures": str(outcomes.count("failure")),
        "errors": str(errors),
        "skipped": str(outcomes.count("skipped")),
        "time": total,
        "timestamp": _iso(result.started_at),
        "hostname": result.environment.get("host") or socket.gethostname(),
    })
    suites = ET.Element("testsuites", name="streamquake", tests=str(tests),
                        failures=str(outcomes.count("failure")), errors=str(errors), time=total)
    suites.append(suite)
    ET.indent(suites)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
    return path


def _iso(epoch: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
