"""Reports on every exit path, through real runs of the CLI (tests/report_runs.py): junit.xml
valid against the Jenkins JUnit schema on success, SLO failure, interruption, exit 3 and exit 2;
failure text that states the breach; "not run" for phases that never ran; whole lines in a CI
log; summary.md with its context; report.json series; the CSV files."""

from __future__ import annotations

import csv
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema

from tests.helpers import assert_verdict
from tests.report_runs import Runs, report_runs

XSD = Path(__file__).with_name("junit") / "jenkins-junit.xsd"
EXPECTED_EXIT = {"a": 0, "a2": 0, "b": 1, "c": 130, "d": 3, "e": 2}


@pytest.fixture(scope="module")
def runs() -> Runs:
    return report_runs()


def _report(runs: Runs, name: str) -> dict:
    return json.loads((runs[name].out / "report.json").read_text())


def _cases(runs: Runs, name: str) -> list[ET.Element]:
    return list(ET.parse(runs[name].out / "junit.xml").getroot().iter("testcase"))


def _not_judged(runs: Runs, name: str, metric: str, phase: str) -> str | None:
    """Why run ``name``'s ``metric`` check in ``phase`` was not judged (its step's load
    generator saturated, on a busy machine), or None: judged."""
    report = _report(runs, name)
    check = next(c for c in report["checks"] if c["metric"] == metric and c["phase"] == phase)
    return check.get("not_judged")


@pytest.mark.timeout(240)
def test_every_exit_path_leaves_valid_junit_summary_json_and_html(runs: Runs) -> None:
    schema = xmlschema.XMLSchema(XSD)
    for name, code in EXPECTED_EXIT.items():
        run = runs[name]
        # A verdict, or the one issue 30 gives a saturated step: not judged (6).
        assert_verdict(run, code, run.out, said=f"run {name}: {run.stdout}")
        for file in ("report.json", "junit.xml", "summary.md", "report.html", "timeline.csv"):
            assert (run.out / file).is_file(), f"run {name} left no {file}"
        schema.validate(run.out / "junit.xml")        # raises with the offending element
        suite = ET.parse(run.out / "junit.xml").getroot().find("testsuite")
        assert suite is not None
        cases = suite.findall("testcase")
        assert suite.get("tests") == str(len(cases))
        for kind, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            assert suite.get(attr) == str(sum(1 for c in cases if c.find(kind) is not None))
        assert _report(runs, name)["exit_code"] == run.returncode


@pytest.mark.timeout(240)
def test_junit_failure_states_the_observation_against_the_limit(runs: Runs) -> None:
    report = _report(runs, "b")
    if why := _not_judged(runs, "b", "ttft_ms", "baseline"):
        # A saturated baseline: its TTFT is not judged, a skipped case that says why.
        (case,) = [c for c in _cases(runs, "b") if "ttft_ms p95" in c.get("name", "")
                   and c.get("classname", "").endswith(".baseline")]
        assert case.find("failure") is None and case.find("skipped") is not None
        assert "the load generator was saturated" in (case.findtext("skipped") or ""), why
        return
    broken = [c for c in report["checks"] if c["gating"] and not c["passed"]]
    assert any(c["metric"] == "ttft_ms" for c in broken)
    failures = {case.get("classname", "").rsplit(".", 1)[-1]: case.find("failure")
                for case in _cases(runs, "b")
                if case.find("failure") is not None and "ttft_ms p95" in case.get("name", "")}
    base = next(c for c in broken if c["metric"] == "ttft_ms" and c["phase"] == "baseline")
    message = failures["baseline"].get("message", "")           # type: ignore[union-attr]
    assert f"was {base['observed']:.1f} ms in baseline" in message, message
    assert "allows at most 250.0 ms" in message and "over by" in message
    assert "observed" not in message and "<=" not in message     # no more "observed X <= limit"
    # Each case's time is the time its phase was measured, not 0.
    for case in _cases(runs, "b"):
        if case.get("classname", "").endswith(".baseline"):
            assert float(case.get("time", "0")) == pytest.approx(5.0, abs=0.05)


@pytest.mark.timeout(240)
def test_non_gating_checks_pass_with_the_measurement_not_skipped(runs: Runs) -> None:
    cases = [c for c in _cases(runs, "a") if c.get("classname", "").endswith(".fault")
             and "ttft_ms" in c.get("name", "")]
    (case,) = cases
    assert case.get("name", "").endswith("(not gating)")
    if why := _not_judged(runs, "a", "ttft_ms", "fault"):
        # A saturated fault step: not judged, a skipped case with the guard's reason.
        assert case.find("failure") is None, ET.tostring(case).decode()
        assert "the load generator was saturated" in (case.findtext("skipped") or ""), why
        return
    assert all(c.find("skipped") is None and c.find("failure") is None for c in cases)
    out = case.findtext("system-out") or ""
    assert out.startswith("not gating in fault (broken): ttft_ms p95 was"), out


@pytest.mark.timeout(240)
def test_interrupted_run_marks_the_phase_that_never_ran_not_run(runs: Runs) -> None:
    report = _report(runs, "c")
    assert report["interrupted"] == "SIGINT"
    status = {p["name"]: p["status"] for p in report["phases"]}
    assert status == {"warmup": "complete", "baseline": "complete", "fault": "partial",
                      "recovery": "not run"}
    recovery = [c for c in _cases(runs, "c") if c.get("classname", "").endswith(".recovery")]
    assert recovery, "the recovery checks are listed"
    for case in recovery:
        assert case.find("failure") is None, ET.tostring(case).decode()
        assert (case.findtext("skipped") or "").startswith("not run"), ET.tostring(case).decode()
    (error,) = [c.find("error") for c in _cases(runs, "c") if c.find("error") is not None]
    assert error is not None and "interrupted by SIGINT during fault" in error.get("message", "")
    # The terminal says "not run" in the recovery column, never a cross.
    verdict_lines = [line for line in runs["c"].stdout.splitlines() if "<=" in line]
    assert verdict_lines and all(line.rstrip(" │").endswith("not run") for line in verdict_lines)
    assert "✗" not in runs["c"].stdout
    assert "| not run |" in (runs["c"].out / "summary.md").read_text() or \
        "| not run" in (runs["c"].out / "summary.md").read_text()


@pytest.mark.timeout(240)
def test_exit_3_and_exit_2_leave_an_error_case_and_every_slo_not_run(runs: Runs) -> None:
    cases = _cases(runs, "d")
    errors = [c.find("error") for c in cases if c.find("error") is not None]
    assert len(errors) == 1 and "is unreachable" in (errors[0].get("message") or "")
    slo_cases = [c for c in cases if c.find("error") is None]
    assert len(slo_cases) == 2 and all(c.find("skipped") is not None for c in slo_cases)
    summary = (runs["d"].out / "summary.md").read_text()
    assert summary.startswith("## streamquake: remote: RUN FAILED (exit 3)")
    assert "is unreachable" in summary and "127.0.0.1" in summary
    assert runs["d"].stdout.count("is unreachable") <= 2      # said once, and once in the end
    broken = _cases(runs, "e")
    assert [c.get("name") for c in broken] == ["run started"]
    assert "load.users" in (broken[0].find("error").get("message") or "")  # type: ignore[union-attr]


@pytest.mark.timeout(240)
def test_ci_log_keeps_fault_readback_and_table_cells_whole(runs: Runs) -> None:
    """stdout is a pipe here, with no COLUMNS: exactly the CI case."""
    out = runs["a"].stdout
    reverted = [line for line in out.splitlines() if "fault reverted chunk-drop" in line]
    assert len(reverted) == 1
    # The proxy's counters, every one, on the one line, none of them cut.
    for key in ("stats.events_dropped=", "stats.first_event_delays=", "stats.bytes=",
                "stats.aborts_by_status.503="):
        assert key in reverted[0], reverted[0]
    assert "..." not in reverted[0] and "{" not in reverted[0]
    # Its settings as the scenario wrote them, never the proxy's echo in its own units.
    assert "fault reverted chunk-drop (drop=20%, first_event_delay=300ms" in reverted[0]
    assert "fault.drop=" not in reverted[0] and "first_event_delay_ms" not in reverted[0]
    # One time base: the log's stamps count from the first phase, as the reports' times do.
    report = json.loads((runs["a"].out / "report.json").read_text())
    t0 = report["phases"][0]["start"]
    (fault,) = [f for f in report["faults"] if f["name"] == "chunk-drop"]
    (applied,) = [line for line in out.splitlines() if "fault applied chunk-drop" in line]
    stamp = re.match(r"\s*([+-]\d+\.\d)s fault applied", applied)
    assert stamp is not None, applied
    # (within a second: the line is printed once the apply is done; the lead alone is 6 s)
    assert abs(float(stamp.group(1)) - (fault["applied_at"] - t0)) <= 1.0, (applied, fault)
    assert "these times count from it, as the reports' do" in out
    ttft_rows = [line for line in out.splitlines() if line.startswith("│ ttft_ms p95 <= 250")]
    assert len(ttft_rows) == 1, out
    if _not_judged(runs, "a", "ttft_ms", "fault"):  # a saturated step: "(22.7 ms not judged)"
        assert "broken" not in ttft_rows[0] and re.search(r"\([\d.]+ ms[^)]*\)", ttft_rows[0]), out
    else:
        assert "(broken, not gating)" in ttft_rows[0], out
    assert not re.search(r"^│\s+│.*gating\)", out, re.M), "a cell wrapped onto a second line"


@pytest.mark.timeout(240)
def test_summary_md_says_when_how_long_against_what_with_which_faults(runs: Runs) -> None:
    summary = (runs["a"].out / "summary.md").read_text()
    head = summary.splitlines()[2]
    code = runs["a"].returncode         # 0, or 6 where a saturated step was not judged
    assert re.match(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC, \d+\.\d s, exit code {code}; ",
                    head), head
    assert "embedded openai target at http://127.0.0.1:" in head and "sha256" in head
    # Its settings as the scenario writes them (issue 34: it said drop=0.2 first_event_delay_ms
    # =300 where the terminal says drop=20%).
    assert "| chunk-drop | sse_proxy | fault | `drop=20%, first_event_delay=300ms" in summary
    assert "stats.events_dropped=" in summary
    # The error breakdown: the proxy aborted some fault-phase streams with 503.
    rows = dict(re.findall(r"^\| (\w+) \| (.*) \|$", summary, re.M))
    report = _report(runs, "a")
    fault = next(p for p in report["phases"] if p["name"] == "fault")
    assert fault["stats"]["errors"]["http_status"] > 0
    assert rows["http_status"].split(" | ")[1] == str(fault["stats"]["errors"]["http_status"])


@pytest.mark.timeout(240)
def test_report_json_carries_the_timeline_and_cdfs_the_html_draws(runs: Runs) -> None:
    report = _report(runs, "a")
    phases = {p["name"]: p for p in report["phases"]}
    timeline = report["timeline"]
    t0 = report["phases"][0]["start"]
    assert len(timeline) == round(report["phases"][-1]["end"] - t0)
    assert {s["phase"] for s in timeline} == set(phases)
    # A CDF comes from the same HDR histogram as the verdict: its p95 is the phase's p95.
    for cdf in report["cdfs"]:
        p95 = dict(cdf["points"])[95.0]
        assert p95 == pytest.approx(phases[cdf["phase"]]["stats"][cdf["metric"]]["p95"],
                                    abs=0.001)
        assert cdf["count"] == phases[cdf["phase"]]["stats"][cdf["metric"]]["count"]
    # The fault shows where it lived: TTFT p50 jumps by the 300 ms first-event delay.
    fault_secs = [s for s in timeline if s["phase"] == "fault" and s["n"]["ttft_ms"]][1:-1]
    base_secs = [s for s in timeline if s["phase"] == "baseline" and s["n"]["ttft_ms"]]
    assert min(s["p50"]["ttft_ms"] for s in fault_secs) > \
        max(s["p50"]["ttft_ms"] for s in base_secs) + 200
    assert report["environment"]["scenario_sha256"] == _report(runs, "a2")["environment"][
        "scenario_sha256"]


@pytest.mark.timeout(240)
def test_csv_files_agree_with_the_report(runs: Runs) -> None:
    report = _report(runs, "a")
    with open(runs["a"].out / "timeline.csv", newline="") as f:
        seconds = list(csv.DictReader(f))
    assert len(seconds) == len(report["timeline"])
    assert [int(s["sent"]) for s in seconds] == [s["sent"] for s in report["timeline"]]
    with open(runs["a"].out / "samples.csv", newline="") as f:
        samples = list(csv.DictReader(f))
    for phase in report["phases"]:
        scored = [s for s in samples if s["phase"] == phase["name"] and s["scored"] == "yes"]
        ended_after = [s for s in samples if s["phase"] == phase["name"]
                       and s["scored"] == "ended_after"]
        # Every request due in a phase is judged there, however late it ended.
        assert len(scored) + len(ended_after) == phase["stats"]["requests"], phase["name"]
        assert len(ended_after) == phase["stats"]["ended_after"].get("e2e_ms", 0), phase["name"]
        assert len(scored) + len(ended_after) == phase["stats"]["sent"], phase["name"]
    errors = sum(1 for s in samples if s["error"] == "http_status" and s["status"] == "503")
    assert errors >= sum(p["stats"]["errors"]["http_status"] for p in report["phases"])
