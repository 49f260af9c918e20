"""Every request due in a step is judged in that step, whenever it ends (issue 30): a fault that
makes requests outlast their step, or time out, is judged by all of them, never by the few that
ended inside it. A real run: the embedded target behind the run's SSE proxy, whose fault holds
each stream's first event back past the step's end and stalls some streams past the timeout."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

SCENARIO = """
name: survivors
target:
  protocol: openai
  embedded: {ttft: 30ms, itl: 5ms, output_tokens: {min: 10, max: 10}, seed: 3}
  timeout: 3s
load:
  arrival: {rate: 8/s, process: constant}
  samples: all
  seed: 3
faults:
  - type: sse_proxy
    name: slow-link
    first_event_delay: 2s
    stall: {probability: 4%, duration: 5s}
    seed: 3
steps:
  - {name: warm, kind: warmup, duration: 1s}
  - {name: before, kind: baseline, duration: 3s}
  - {name: hurt, kind: fault, duration: 3s, faults: [slow-link]}
  - {name: after, kind: recovery, duration: 3s}
slos:
  - {metric: error_rate, max: 1%, phases: [fault]}
  - {metric: ttft_ms, percentile: 95, max: 1s, phases: [fault]}
verdicts: {inconclusive: pass}
"""


@pytest.mark.timeout(150)
def test_requests_that_outlast_the_fault_step_are_judged_in_it(tmp_path: Path,
                                                                state_dir: Path) -> None:
    path = tmp_path / "survivors.yaml"
    path.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--out", str(out), timeout=140)
    report = json.loads((out / "report.json").read_text())
    hurt = next(p for p in report["phases"] if p["name"] == "hurt")["stats"]
    with open(out / "samples.csv", newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == "hurt"]

    # Every request sent in the step is one of its requests, its outcome counted there.
    assert rows and hurt["sent"] == hurt["requests"] == len(rows), hurt
    timed_out = [r for r in rows if r["error"] == "timeout"]
    late = [r for r in rows if r["scored"] == "ended_after"]
    # A first event held 2 s in a 3 s step: most of the step's requests end after it, and the
    # stalled ones outlast the 3 s timeout; the rule this replaces judged the step by the rest.
    assert len(late) > len(rows) / 2, (len(late), len(rows))
    assert timed_out, "no stream outlasted the timeout: the stall did not bite"
    assert hurt["errors"]["timeout"] == len(timed_out)
    assert hurt["ended_after"]["e2e_ms"] == len(late)
    # TTFT: the measured first tokens and the timed-out streams' lower bounds, every request.
    ttft = hurt["ttft_ms"]
    no_token = [r for r in rows if not r["ttft_ms"]]
    assert ttft["count"] == len(rows) - len(no_token)
    assert ttft["censored"] == sum(r["error"] == "timeout" for r in no_token)
    # Against the run's own baseline: the held first event shows in the fault step's p50, not
    # only in a tail; and its p95 is no survivor's (the slowest measured, or a lower bound).
    before = next(p for p in report["phases"] if p["name"] == "before")["stats"]
    assert ttft["p50"] > before["ttft_ms"]["p50"] + 1500.0, (ttft, before["ttft_ms"])
    measured = sorted(float(r["ttft_ms"]) for r in rows if r["ttft_ms"])
    assert ttft["p95"] >= measured[int(0.9 * len(measured))] - 1.0
    # The timeouts break the step's error budget, and the run says so.
    checks = {(c["metric"], c["phase"]): c for c in report["checks"]}
    errors = checks["error_rate", "hurt"]
    assert not errors["passed"] and errors["samples"] == len(rows), errors
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
