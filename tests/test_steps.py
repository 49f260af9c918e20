"""Experiments as timelines (``steps:``): several faults in one run, each judged against the
baseline step before it and the recovery step after it; bad timelines refused at validation with
located errors; ``phases:`` as the short form of the same thing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from streamquake.errors import ScenarioError
from streamquake.scenario import parse_scenario
from tests.conftest import run_cli
from tests.helpers import assert_run_ok

TARGET = """
name: {name}
target:
  protocol: openai
  embedded:
    ttft: 60ms
    itl: 10ms
    output_tokens: {{min: 30, max: 30}}
    seed: 5
    sse_event_ids: true
  timeout: 10s
load:
  users: 4
  think_time: {{min: 50ms, max: 100ms}}
  seed: 5
"""

THREE = TARGET + """
faults:
  - {{type: sse_proxy, name: slow-first, first_event_delay: 300ms}}
  - {{type: sse_proxy, name: slow-tokens, delay: 40ms}}
  - {{type: sse_proxy, name: lossy, drop: 20%, seed: 5}}
steps:
  - {{name: warm, kind: warmup, duration: 1s}}
  - {{name: before, kind: baseline, duration: 4s}}
  - {{name: f-first, kind: fault, duration: 4s, faults: [slow-first]}}
  - {{name: r-first, kind: recovery, duration: 4s}}
  - {{name: f-tokens, kind: fault, duration: 4s, faults: [slow-tokens]}}
  - {{name: r-tokens, kind: recovery, duration: 4s}}
  - {{name: again, kind: baseline, duration: 4s}}
  - {{name: f-lossy, kind: fault, duration: 4s, faults: [lossy]}}
  - {{name: r-lossy, kind: recovery, duration: 4s}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 250ms, phases: [baseline, recovery]}}
  - {{metric: chunk_loss, max: 2%, phases: [baseline, recovery]}}
recovery: {{tolerance: 50%}}
verdicts: {{inconclusive: pass}}
"""


def _steps(report: dict) -> dict[str, dict]:
    return {p["name"]: p for p in report["phases"]}


@pytest.mark.timeout(150)
def test_three_faults_in_one_run_each_seen_in_its_own_step_and_judged_before_and_after(
        tmp_path: Path, state_dir: Path) -> None:
    path = tmp_path / "three.yaml"
    path.write_text(THREE.format(name="three"))
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--out", str(out), timeout=140)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    steps = _steps(report)
    assert list(steps) == ["warm", "before", "f-first", "r-first", "f-tokens", "r-tokens",
                           "again", "f-lossy", "r-lossy"]
    assert [steps[s]["kind"] for s in steps][:4] == ["warmup", "baseline", "fault", "recovery"]

    def p50(step: str, metric: str) -> float:
        return float(steps[step]["stats"][metric]["p50"])

    def loss(step: str) -> float:
        return float(steps[step]["stats"]["chunk_loss"])

    # Each fault's effect in its own step, against the steps around it in the same run.
    assert p50("f-first", "ttft_ms") > p50("before", "ttft_ms") + 200
    assert p50("f-first", "ttft_ms") > p50("r-first", "ttft_ms") + 200
    for other in ("f-tokens", "f-lossy"):
        assert p50(other, "ttft_ms") < p50("f-first", "ttft_ms") - 200
    assert p50("f-tokens", "itl_ms") > p50("r-first", "itl_ms") + 20
    assert p50("f-tokens", "itl_ms") > p50("r-tokens", "itl_ms") + 20
    for other in ("f-first", "f-lossy"):
        assert p50(other, "itl_ms") < p50("f-tokens", "itl_ms") - 20
    assert loss("f-lossy") > 0.1
    assert all(loss(s) == 0.0 for s in steps if s not in ("warm", "f-lossy", "again"))
    # A request sent in the step before the lossy one and still streaming when it began counts
    # where it was sent (every request is judged in its step): loss there only from such ones.
    assert loss("again") == 0.0 or steps["again"]["stats"]["ended_after"].get("e2e_ms"), steps
    assert loss("again") < loss("f-lossy") / 3

    # Each fault applied once, in its step, and reverted.
    by_name = {f["name"]: f for f in report["faults"]}
    assert {f: by_name[f]["phase"] for f in by_name} == {
        "slow-first": "f-first", "slow-tokens": "f-tokens", "lossy": "f-lossy"}
    for f in by_name.values():
        step = steps[f["phase"]]
        assert step["start"] - 0.5 <= f["applied_at"] < f["reverted_at"] <= step["end"] + 0.5

    # Before / during / after: each fault step with its own baseline and recovery step.
    assert report["judged"] == [
        {"step": "f-first", "faults": ["slow-first"], "before": "before", "after": "r-first"},
        {"step": "f-tokens", "faults": ["slow-tokens"], "before": "before",
         "after": "r-tokens"},
        {"step": "f-lossy", "faults": ["lossy"], "before": "again", "after": "r-lossy"},
    ]
    recovery = [c for c in report["checks"] if c["kind"] == "recovery"]
    assert {(c["judges"], c["phase"]) for c in recovery} == {
        ("f-first", "r-first"), ("f-tokens", "r-tokens"), ("f-lossy", "r-lossy")}
    assert all(c["detail"].startswith(f"after {c['judges']}: ") for c in recovery)
    # SLOs gate in the steps of the kinds they name, and are shown everywhere else.
    gating = {(c["metric"], c["phase"]) for c in report["checks"]
              if c["kind"] == "slo" and c["gating"]}
    assert ("chunk_loss", "r-lossy") in gating and ("chunk_loss", "again") in gating
    assert ("chunk_loss", "f-lossy") not in gating
    shown = {(c["metric"], c["phase"]) for c in report["checks"] if c["kind"] == "slo"}
    assert ("chunk_loss", "f-lossy") in shown and ("ttft_ms", "f-first") in shown


@pytest.mark.timeout(120)
def test_a_fault_named_by_consecutive_steps_stays_applied_across_them(
        tmp_path: Path, state_dir: Path) -> None:
    path = tmp_path / "held.yaml"
    path.write_text(TARGET.format(name="held") + """
faults:
  - {type: sse_proxy, name: lossy, drop: 20%, seed: 5}
  - {type: sse_proxy, name: slow, first_event_delay: 200ms}
steps:
  - {name: before, kind: baseline, duration: 3s}
  - {name: small, kind: fault, duration: 3s, faults: [lossy]}
  - {name: both, kind: fault, duration: 3s, faults: [lossy, slow]}
  - {name: after, kind: recovery, duration: 3s}
""")
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--out", str(out), timeout=100)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    records = [f for f in report["faults"] if f["name"] == "lossy"]
    assert len(records) == 1, records      # applied once, not reverted between the steps
    steps = _steps(report)
    assert records[0]["applied_at"] < steps["small"]["end"] < records[0]["reverted_at"]
    assert records[0]["reverted_at"] <= steps["both"]["end"] + 0.5
    assert steps["small"]["stats"]["chunk_loss"] > 0.1
    assert steps["both"]["stats"]["chunk_loss"] > 0.1
    assert steps["after"]["stats"]["chunk_loss"] == 0.0


def _problems(text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "bad.yaml")
    return "\n".join(info.value.problems)


BAD_BASE = TARGET.format(name="bad") + """
faults:
  - {type: sse_proxy, name: lossy, drop: 20%}
"""


@pytest.mark.parametrize(("steps", "said"), [
    ("""
  - {name: f, kind: fault, duration: 3s, faults: [lossy]}
  - {name: base, kind: baseline, duration: 3s}""",
     "steps.0 (f): a fault step needs a baseline step before it"),
    ("""
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fault, duration: 3s, faults: [lossey]}""",
     "steps.1 (f): no fault is named 'lossey' (faults: lossy)"),
    ("""
  - {name: base, kind: baseline, duration: 3s}
  - {name: base, kind: fault, duration: 3s, faults: [lossy]}""",
     "two steps are named 'base'"),
    ("""
  - {name: base, kind: baseline, duration: 3s, faults: [lossy]}""",
     "steps.0 (base): a baseline step runs no faults"),
    ("""
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fault, duration: 3s}""",
     "fault 'lossy' is in no step"),
    ("""
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fault, duration: 3s, faults: [lossy],
     load: {rate: 5, spike: {rate: 9, at: 2s, for: 2s}}}""",
     "the spike ends 4 s into a step of 3 s"),
    ("""
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fualt, duration: 3s, faults: [lossy]}""",
     "steps.1.kind"),
])
def test_a_bad_timeline_is_refused_at_validation_with_where_and_why(steps: str, said: str) -> None:
    problems = _problems(BAD_BASE + "steps:" + steps + "\n")
    assert said in problems, problems
    assert "bad.yaml:" in problems


def test_phases_and_steps_together_or_neither_are_refused() -> None:
    both = BAD_BASE + """phases: {baseline: 3s, fault: 3s, recovery: 3s}
steps:
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fault, duration: 3s, faults: [lossy]}
"""
    assert "give either 'phases'" in _problems(both)
    assert "give 'phases'" in _problems(BAD_BASE)


def test_a_fault_with_a_phase_in_a_steps_scenario_is_refused() -> None:
    text = TARGET.format(name="bad") + """
faults:
  - {type: sse_proxy, name: lossy, drop: 20%, phase: recovery}
steps:
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fault, duration: 3s, faults: [lossy]}
"""
    assert "fault 'lossy': its steps say when it runs: remove 'phase: recovery'" in \
        _problems(text)


def test_an_slo_naming_an_unknown_step_is_refused() -> None:
    text = BAD_BASE + """steps:
  - {name: base, kind: baseline, duration: 3s}
  - {name: f, kind: fault, duration: 3s, faults: [lossy]}
slos:
  - {metric: error_rate, max: 1%, phases: [bsae]}
"""
    # Located at the name, with the step it is closest to.
    assert re.search(r"bad\.yaml:\d+:\d+: slos\.0\.phases\.0: 'bsae' is no step and no kind: "
                     r"did you mean 'base'\?", _problems(text)), _problems(text)


def test_phases_are_the_four_steps_named_as_their_kinds() -> None:
    scenario = parse_scenario(BAD_BASE.replace("drop: 20%}", "drop: 20%, phase: fault}") +
                              "phases: {warmup: 1s, baseline: 3s, fault: 2s, recovery: 4s}\n",
                              "ok.yaml")
    assert [(s.name, s.kind, s.duration_s, s.faults) for s in scenario.timeline] == [
        ("warmup", "warmup", 1.0, ()), ("baseline", "baseline", 3.0, ()),
        ("fault", "fault", 2.0, ("lossy",)), ("recovery", "recovery", 4.0, ())]
    assert scenario.total_s == 10.0
