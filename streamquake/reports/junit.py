"""junit.xml: one test case per SLO check and phase, so CI systems show each verdict."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from streamquake.result import Check, RunResult


def _fmt(value: float | None) -> str:
    return "no data" if value is None else f"{value:.4g}"


def _case(suite: ET.Element, check: Check, scenario: str) -> None:
    cls = f" [{check.cls}]" if check.cls else ""
    case = ET.SubElement(
        suite,
        "testcase",
        classname=f"streamquake.{scenario}.{check.phase}",
        name=f"{check.name}{cls}",
        time="0",
    )
    text = (
        f"{check.metric} observed {_fmt(check.observed)} {check.op} {_fmt(check.threshold)}"
        + (f"; {check.detail}" if check.detail else "")
    )
    if not check.gating:
        state = "met" if check.passed else "broken"
        ET.SubElement(case, "skipped", message=f"not gating in {check.phase}; {state}: {text}")
    elif not check.passed:
        failure = ET.SubElement(case, "failure", message=f"SLO broken: {text}", type="SLOBroken")
        failure.text = text
    else:
        ET.SubElement(case, "system-out").text = text


def write_junit(result: RunResult, path: Path) -> Path:
    suites = ET.Element("testsuites", name="streamquake")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"streamquake.{result.scenario_name}",
        tests=str(len(result.checks) + (1 if result.interrupted else 0)),
        failures=str(len(result.broken)),
        errors="1" if result.interrupted else "0",
        skipped=str(sum(1 for c in result.checks if not c.gating)),
        time=f"{max(0.0, result.finished_at - result.started_at):.3f}",
    )
    for check in result.checks:
        _case(suite, check, result.scenario_name)
    if result.interrupted:
        case = ET.SubElement(suite, "testcase", classname=f"streamquake.{result.scenario_name}",
                             name="run completed", time="0")
        ET.SubElement(case, "error", message=f"run interrupted by {result.interrupted}",
                      type="Interrupted")
    ET.indent(suites)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
    return path
