"""Every output over N steps (``steps:``): the terminal at 80 columns (an overview of the
timeline, then one block per fault step: before / during / after), summary.md, junit.xml (valid
against the schema the suite uses), report.json, the live lines and ``--dry-run``; and an abort
in a steps run: everything reverted, the fault steps still to come skipped, recovery still run
and reported. Real runs against the embedded target through the real CLI."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema

from tests.conftest import run_cli
from tests.helpers import assert_run_ended

XSD = Path(__file__).with_name("junit") / "jenkins-junit.xsd"

TARGET = """
name: {name}
target:
  protocol: openai
  embedded: {{ttft: 30ms, itl: 10ms, output_tokens: {{min: 20, max: 20}}, seed: 7,
              sse_event_ids: true}}
  timeout: 10s
load: {{users: 4, think_time: {{min: 30ms, max: 60ms}}, seed: 7}}
"""

THREE = TARGET + """
faults:
  - {{type: sse_proxy, name: late-first, first_event_delay: 200ms}}
  - {{type: sse_proxy, name: slow-tokens, delay: 30ms}}
  - {{type: sse_proxy, name: lossy, drop: 20%, seed: 7}}
steps:
  - {{name: warm, kind: warmup, duration: 1s}}
  - {{name: before, kind: baseline, duration: 3s}}
  - {{name: f-late, kind: fault, duration: 3s, faults: [late-first]}}
  - {{name: f-late-slow, kind: fault, duration: 2s, faults: [late-first, slow-tokens]}}
  - {{name: r-late, kind: recovery, duration: 3s}}
  - {{name: f-lossy, kind: fault, duration: 3s, faults: [lossy]}}
  - {{name: r-lossy, kind: recovery, duration: 3s}}
  - {{name: tail, kind: baseline, duration: 2s}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 2s, phases: [baseline, recovery]}}
  - {{metric: chunk_loss, max: 50%}}
recovery: {{tolerance: 100%, metrics: [ttft_ms]}}
verdicts: {{inconclusive: pass}}
abort_when:
  - {{metric: error_rate, above: 90%, for: 5s}}
"""

STEPS = ["warm", "before", "f-late", "f-late-slow", "r-late", "f-lossy", "r-lossy", "tail"]
FAULT_STEPS = {"f-late": ("before", "r-late"), "f-late-slow": ("before", "r-late"),
               "f-lossy": ("before", "r-lossy")}

ABORTING = TARGET + """
faults:
  - {{type: sse_proxy, name: outage, abort: {{status: 503, probability: 100%}}}}
  - {{type: sse_proxy, name: slow, delay: 20ms}}
steps:
  - {{name: warm, kind: warmup, duration: 0.5s}}
  - {{name: before, kind: baseline, duration: 3s}}
  - {{name: f-out, kind: fault, duration: 8s, faults: [outage]}}
  - {{name: r-out, kind: recovery, duration: 3s}}
  - {{name: f-slow, kind: fault, duration: 3s, faults: [slow]}}
  - {{name: r-slow, kind: recovery, duration: 3s}}
abort_when:
  - {{metric: error_rate, above: 50%, for: 1s}}
slos:
  - {{metric: error_rate, max: 1%, phases: [baseline, recovery]}}
recovery: {{tolerance: 100%, metrics: [ttft_ms]}}
verdicts: {{inconclusive: pass}}
"""


def _flat(text: str) -> str:
    return " ".join(text.split())


def _blocks(stdout: str, name: str) -> list[str]:
    """The lines print_result writes from the timeline's title to the warnings."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{name}: the timeline"))
    end = next((i for i, ln in enumerate(lines) if i > start and ln.startswith("warning:")),
               len(lines) - 1)
    return lines[start:end]


@pytest.mark.timeout(150)
def test_every_output_shows_every_step_and_each_fault_before_during_after(
        tmp_path: Path, state_dir: Path) -> None:
    path, out = tmp_path / "three.yaml", tmp_path / "out"
    path.write_text(THREE.format(name="three"))
    proc = run_cli("run", str(path), "--out", str(out), env={"COLUMNS": "80"}, timeout=140)
    assert_run_ended(proc)

    # report.json: every step with its kind and faults, and each fault step's judges.
    report = json.loads((out / "report.json").read_text())
    assert report["steps_form"] is True
    assert [p["name"] for p in report["phases"]] == STEPS
    assert {j["step"]: (j["before"], j["after"]) for j in report["judged"]} == FAULT_STEPS
    assert all(p["status"] == "complete" for p in report["phases"])

    # The terminal, as a CI log at 80 columns: the timeline, then a block per fault step.
    blocks = _blocks(proc.stdout, "three")
    too_long = [ln for ln in blocks if len(ln) > 80]
    assert not too_long, "\n".join(too_long)
    flat = _flat("\n".join(blocks))
    for step in STEPS:
        assert re.search(rf"│ {re.escape(step)}\s+│ \w+", "\n".join(blocks)), step
    assert "fault step f-late (fault late-first): before before / during f-late / after " \
           "r-late" in flat
    assert "fault step f-late-slow (faults late-first, slow-tokens): before before / during " \
           "f-late-slow / after r-late" in flat
    assert "fault step f-lossy (fault lossy): before before / during f-lossy / after " \
           "r-lossy" in flat
    assert flat.count("measured before during after") == 3
    # Its recovery checks with the counts and intervals behind both sides, and its fault.
    assert "recovers to baseline +100% (" in flat and "): after f-lossy: before " in flat
    assert re.search(r"after f-lossy: before [\d.]+ \(n=\d+", flat), flat
    assert "fault lossy (sse_proxy): applied and reverted" in flat
    # A step that judges no fault step still shows its verdicts.
    assert "SLO verdicts in the other steps" in flat and re.search(r"│ tail\s+│", "\n".join(
        blocks[[i for i, ln in enumerate(blocks) if "other steps" in ln][0]:]))

    # The live lines (a CI log): the step, its kind, the time left, the next step.
    assert re.search(r"live: step f-late \(fault\) \d+ s left, next f-late-slow \(fault\)|"
                     r"live: step \S+ \(\w+\) \d+ s left, (next \S+ \(\w+\)|the last step)",
                     proc.stdout), proc.stdout[-3000:]
    assert re.search(r"step f-late-slow \(fault, 2 s; faults late-first, slow-tokens\)",
                     proc.stdout)

    # summary.md: the same structure.
    md = (out / "summary.md").read_text()
    for step in STEPS:
        assert re.search(rf"^\| {re.escape(step)} \| (warmup|baseline|fault|recovery) \|", md,
                         re.M), step
    for step, (before, after) in FAULT_STEPS.items():
        assert re.search(rf"^### fault step {step} \(.*\): before {before} / during {step} / "
                         rf"after {after}$", md, re.M), step
        assert f"| | before `{before}` | during `{step}` | after `{after}` |" in md
    assert "### SLO verdicts in the other steps" in md and "| tail |" in md

    # junit.xml: valid; every step a property; a case per (step, SLO) and per recovery check.
    xmlschema.XMLSchema(XSD).validate(out / "junit.xml")
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    props = [p.get("name") for p in suite.iter("property")]
    assert [n for n in props if n and n.startswith("step.")] == [
        f"step.{i}.{s}" for i, s in enumerate(STEPS)]
    cases = {(c.get("classname"), c.get("name")) for c in suite.iter("testcase")}
    for step in STEPS[1:]:
        assert ("streamquake.three." + step, "chunk_loss <= 50%") in cases, step
    for step, (_, after) in FAULT_STEPS.items():
        assert (f"streamquake.three.{after}",
                f"ttft_ms p95 recovers to baseline +100% after {step}") in cases, step
    assert len(cases) == len(list(suite.iter("testcase")))        # no two cases alike

    # --dry-run: what changes when (a fault held across consecutive steps applied once) and how
    # it is undone, and what an abort does.
    plan = run_cli("run", str(path), "--dry-run").stdout
    assert "step f-late-slow (fault): +7s to +9s" in plan
    assert "+4s to +9s (f-late, f-late-slow): sse_proxy 'late-first'" in plan
    assert "'late-first' stays applied from f-late" in plan
    assert re.search(r"'late-first' .*; reverted at \+9s as r-late begins", plan)
    assert re.search(r"\+12s to \+15s \(f-lossy\): sse_proxy 'lossy' .*; reverted at \+15s as "
                     r"r-lossy begins", plan)
    assert "abort when error_rate above 90% for 5s: every fault is reverted at once" in plan


@pytest.mark.timeout(150)
def test_an_abort_in_a_steps_run_reverts_skips_the_later_fault_steps_and_reports_recovery(
        tmp_path: Path, state_dir: Path) -> None:
    path, out = tmp_path / "abort.yaml", tmp_path / "out"
    path.write_text(ABORTING.format(name="abort-steps"))
    proc = run_cli("run", str(path), "--out", str(out), env={"COLUMNS": "80"}, timeout=140)
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "ABORTED in f-out: abort condition 'error_rate above 50% for 1s' held" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    steps = {p["name"]: p for p in report["phases"]}
    assert {n: p["status"] for n, p in steps.items()} == {
        "warm": "complete", "before": "complete", "f-out": "complete", "r-out": "complete",
        "f-slow": "skipped", "r-slow": "complete"}
    # Everything reverted: the outage long before its step's end; "slow" never applied.
    (outage,) = [f for f in report["faults"] if f["name"] == "outage"]
    assert outage["error"] is None and outage["reverted_at"] < steps["f-out"]["end"] - 2
    assert all(f["applied_at"] is None for f in report["faults"] if f["name"] == "slow")
    assert json.loads((state_dir / "journal.json").read_text()) == []
    # The recovery steps still ran, free of errors, and are reported.
    for rec in ("r-out", "r-slow"):
        assert steps[rec]["stats"]["requests"] > 5 and steps[rec]["stats"]["error_rate"] == 0.0
    checks = report["checks"]
    assert any(c["phase"] == "r-slow" and c["kind"] == "slo" and c["ran"] for c in checks)
    judged_slow = [c for c in checks if c["judges"] == "f-slow"]
    assert judged_slow and not any(c["ran"] for c in judged_slow)

    # Every output says the fault step was skipped, and why its checks did not run.
    blocks = _blocks(proc.stdout, "abort-steps")
    assert not [ln for ln in blocks if len(ln) > 80]
    flat = _flat("\n".join(blocks))
    assert re.search(r"│ f-slow\s+│ fault\s+│ slow\s+│\s+3 s │ skipped", "\n".join(blocks))
    assert "fault step f-slow (fault slow): before before / during f-slow / after r-slow " \
           "skipped: the run aborted before this step" in flat
    md = (out / "summary.md").read_text()
    assert "| f-slow | fault | slow | 3 s | skipped |" in md
    assert "Skipped: the run aborted before this step" in md
    xmlschema.XMLSchema(XSD).validate(out / "junit.xml")
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    skipped = [c for c in suite.iter("testcase") if c.get("name", "").endswith("after f-slow")]
    assert skipped and all(
        (s := c.find("skipped")) is not None and s.text is not None
        and "the run aborted before fault step f-slow" in s.text for c in skipped)
