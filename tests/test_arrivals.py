"""Open-loop arrivals the client could not send are counted, never lost: a real run (CLI,
embedded target, Locust) at a rate far beyond what max_inflight allows, and a real Locust
whose users are stopped while arrivals still wait for a slot."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.errors import EXIT_SLO_BROKEN
from streamquake.loadgen.plan import LoadPlan
from streamquake.run.launcher import start_locust
from tests.conftest import run_cli

RATE, USERS, PHASE_S = 16.0, 2, 2.0

# 4 streams at a time of ~350 ms each serve ~11/s; 16/s arrive. The backlog grows all run, so
# the arrivals due last are still waiting for a slot when the run ends.
OVERLOAD = f"""
name: overload
target:
  protocol: openai
  embedded:
    ttft: 300ms
    itl: 10ms
    output_tokens: {{min: 5, max: 5}}
    seed: 3
  timeout: 5s
load:
  users: {USERS}
  arrival: {{rate: {RATE:g}/s, process: constant, max_inflight: 4}}
  seed: 5
phases: {{warmup: 5s, baseline: {PHASE_S:g}s, fault: {PHASE_S:g}s, recovery: 0s}}
slos:
  - {{metric: not_sent_rate, max: 1%}}
"""


def _jsonl(directory: Path, prefix: str) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob(f"{prefix}-*.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_an_overloaded_open_loop_counts_every_arrival_and_breaks_the_not_sent_slo(
        tmp_path: Path, state_dir: Path) -> None:
    scenario = tmp_path / "overload.yaml"
    scenario.write_text(OVERLOAD)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=100)
    assert proc.returncode == EXIT_SLO_BROKEN, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p for p in report["phases"]}
    requests = [r for r in _jsonl(out / "run" / "samples", "samples") if not r["retried"]]
    unsent = _jsonl(out / "run" / "samples", "unsent")
    assert unsent and {u["reason"] for u in unsent} == {"run_ended"}
    # The load began before the baseline: every measured phase saw a full schedule. (A warm-up
    # of 5 s: on a busy machine Locust began 4.5 s into one of 2 s.)
    assert min(r["scheduled"] for r in requests) < phases["baseline"]["start"]
    total_unsent = 0
    for name in ("baseline", "fault"):
        phase = phases[name]
        stats = phase["stats"]

        def due_here(r: dict, phase: dict = phase) -> bool:
            return bool(phase["start"] <= r["scheduled"] < phase["end"])

        sent = sum(map(due_here, requests))
        not_sent = sum(map(due_here, unsent))
        # Each user's constant process puts exactly rate/users x the phase's length arrivals
        # in any window that long; so the arrivals due, sent or not, are the plan's.
        assert abs((sent + not_sent) - RATE * PHASE_S) <= USERS, (name, sent, not_sent)
        assert (stats["sent"], stats["not_sent"]) == (sent, not_sent), name
        assert stats["not_sent_rate"] == pytest.approx(not_sent / (sent + not_sent))
        total_unsent += not_sent
    fault = phases["fault"]["stats"]
    assert fault["not_sent"] > 0
    assert total_unsent == sum(not u["scheduled"] < phases["baseline"]["start"] for u in unsent)
    # What was sent waited for its slot, and the latency from the schedule says so (where a
    # wait outlasted its phase, it still counts there, and is counted as ended after it).
    waits = [p["stats"] for p in report["phases"] if p["stats"]["ttft_scheduled_ms"]["count"]]
    assert waits
    for st in waits:    # the same requests, each timed from its due time and from its send
        assert st["ttft_scheduled_ms"]["count"] == st["ttft_ms"]["count"]
        assert st["ttft_scheduled_ms"]["p95"] >= st["ttft_ms"]["p95"]
    assert max(st["ttft_scheduled_ms"]["max"] - st["ttft_ms"]["max"] for st in waits) > 300
    assert sum(p["stats"]["ended_after"].get("queue_delay_ms", 0)
               for p in report["phases"]) > 0

    broken = [c for c in report["checks"] if not c["passed"]]
    assert {c["metric"] for c in broken} == {"not_sent_rate"}
    assert "fault" in {c["phase"] for c in broken}
    warning = f"phase fault: {fault['not_sent']} of {fault['sent'] + fault['not_sent']} " \
              "arrivals due were never sent"
    assert any(w.startswith(warning) for w in report["errors"]), report["errors"]
    # Shown wherever the run is read: the terminal, summary.md and junit.xml.
    assert "SLO BROKEN" in proc.stdout and "ALL SLOs MET" not in proc.stdout
    assert "arrivals not sent" in proc.stdout and warning in proc.stdout
    summary = (out / "summary.md").read_text()
    row = next(line for line in summary.splitlines() if line.startswith("| arrivals not sent"))
    assert f" {fault['not_sent']} |" in row
    assert warning in summary
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["fault.not_sent"] == str(fault["not_sent"])
    failures = [f.get("message") or "" for f in suite.iter("failure")]
    assert any("not_sent_rate" in m and "fault" in m for m in failures), failures
    assert warning in (suite.findtext("system-err") or "")


@pytest.mark.timeout(90)
def test_arrivals_waiting_for_a_slot_when_the_users_are_stopped_are_recorded(
        tmp_path: Path) -> None:
    # One user with two slots, both held by 12 s streams from its first two arrivals; at end_at
    # Locust waits 1 s for them, then kills the user with every later arrival still queued.
    # The streams must outlast end_at + 1 s however soon Locust starts: with 8 s streams and
    # end_at 8 s away, a Locust that started within 1 s saw them end first, so the queued
    # arrivals took their slots after end_at and were recorded "run_ended" instead.
    config = TargetConfig.model_validate(
        {"ttft": "12s", "itl": "10ms", "output_tokens": {"min": 2, "max": 2}})
    rate = 10.0
    with start_target(config) as target:
        plan = LoadPlan.model_validate({
            "base_url": target.url, "protocol": "openai", "users": 1, "spawn_rate": 100,
            # Locust's start on a busy machine took 4 s, the whole window: 8 s leave room.
            "samples_path": str(tmp_path / "samples"), "end_at": time.time() + 8.0,
            "timeout_s": 20.0,
            "arrival": {"mode": "open", "rate_per_s": rate, "process": "constant",
                        "max_inflight": 2}})
        run = start_locust(plan, tmp_path, run_time_s=plan.end_at - time.time() + 5,
                           stop_timeout_s=1)
        try:
            rc = run.wait(timeout=plan.end_at - time.time() + 20)
        finally:
            run.stop()
    assert rc == 0, (tmp_path / "locust.log").read_text()[-3000:]
    unsent = run.unsent()
    assert unsent and {u.reason for u in unsent} == {"stopped"}
    assert all(u.given_up >= plan.end_at + 0.9 for u in unsent)
    # One constant schedule, 100 ms apart, from the third arrival (the two streams cut off in
    # flight were sent, and never ended) to the last one before end_at: none missing.
    due = sorted(u.scheduled for u in unsent)
    gaps = [b - a for a, b in zip(due, due[1:], strict=False)]
    assert all(g == pytest.approx(1 / rate, abs=1e-6) for g in gaps), gaps
    assert plan.end_at - 1 / rate <= due[-1] < plan.end_at
    assert run.samples() == []
