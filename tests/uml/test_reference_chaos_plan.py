"""The shipped reference chaos plan (scenarios/reference-chaos-plan.yaml) through the real CLI in
a kernel that has netem (User-Mode Linux), against the emulated NVIDIA driver: three faults in
sequence, each seen in its own fault step only, each judged against its before and after step,
and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import assert_run_ok
from tests.nvml_shim import FakeGpus

pytestmark = [
    pytest.mark.uml,
    pytest.mark.skipif(os.environ.get("STREAMQUAKE_UML") != "1",
                       reason="runs inside User-Mode Linux: tests/test_netem_uml_gate.py runs it"),
]

SCENARIO = "scenarios/reference-chaos-plan.yaml"
# fault step -> (its before step, its after step), in the order they run.
PLAN = {"jitter": ("before-jitter", "after-jitter"),
        "downclock": ("before-downclock", "after-downclock"),
        "drop": ("before-drop", "after-drop")}


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.startswith("sq-")}


@pytest.mark.timeout(400)     # 78 s of steps; the rest is for a hang (or UML on a busy host)
def test_reference_chaos_plan(tmp_path: Path, state_dir: Path) -> None:
    gpus = FakeGpus(tmp_path / "nvml-state.txt", gpu_count=1)
    original = gpus.text()
    out = tmp_path / "out"
    proc = run_cli("run", SCENARIO, "--out", str(out), env=gpus.env(), timeout=390)
    assert_run_ok(proc, out)      # 6 where UML's one slow CPU saturated the load generator
    report = json.loads((out / "report.json").read_text())
    stats = {p["name"]: p["stats"] for p in report["phases"]}
    assert all(p["status"] == "complete" for p in report["phases"]), report["phases"]

    def p50(metric: str, step: str) -> float:
        return float(stats[step][metric]["p50"])

    for step, s in stats.items():     # shown when an assertion fails (and with -s)
        if s["requests"]:
            print(f"{step:>16}: n={s['requests']} TTFB p50 {p50('ttfb_ms', step):.1f} p95 "
                  f"{s['ttfb_ms']['p95']:.1f} ms, ITL p50 {p50('itl_ms', step):.1f} ms, "
                  f"chunk_loss {s['chunk_loss']:.3f}")

    # Each fault shows in its own step, against its own before step, and in no other step.
    # netem 100 ms +- 30 ms toward the target: a request on the proxy's pooled connection waits
    # for one delayed trip (70-130 ms), one on a new connection for two (SYN, then the request);
    # the median lands between one trip's least and two trips' mean. The other faults leave the
    # first byte (the target's headers, sent before its TTFT) alone: less than half of one trip.
    for fault, (before, after) in PLAN.items():
        added = p50("ttfb_ms", fault) - p50("ttfb_ms", before)
        low, high = (70, 200) if fault == "jitter" else (-50, 50)
        assert low <= added <= high, (fault, stats[before]["ttfb_ms"], stats[fault]["ttfb_ms"])
        assert p50("ttfb_ms", after) - p50("ttfb_ms", before) < 50, (after, stats[after])
    # SM clocks 500-800 MHz on a GPU of 1980 MHz: the target's tokens come ~2.5x slower.
    for fault, (before, after) in PLAN.items():
        ratio = p50("itl_ms", fault) / p50("itl_ms", before)
        assert (ratio > 2.0) if fault == "downclock" else (ratio < 1.3), (fault, ratio)
        assert p50("itl_ms", after) < 1.3 * p50("itl_ms", before), (after, stats[after])
    # 15% of content chunks dropped by the proxy: chunk_loss about 15% there, none elsewhere.
    loss = {step: s["chunk_loss"] for step, s in stats.items() if s["requests"]}
    assert 0.09 <= loss["drop"] <= 0.22, loss
    assert all(v == 0 for step, v in loss.items() if step not in ("drop", "before-drop")), loss
    # A request due in the step before ends in the drop step at times, and counts where it was
    # due (every request is judged in its step): loss there only from such requests.
    assert loss["before-drop"] == 0 or stats["before-drop"]["ended_after"].get("e2e_ms"), (
        loss, stats["before-drop"]["ended_after"])
    assert loss["before-drop"] < loss["drop"] / 3, loss
    # No errors in any step that had requests (a warm-up the load process started too late
    # for has none, and no error rate: UML starts Locust slowly on a busy host).
    errors = {k: {kind: n for kind, n in s["errors"].items() if n} for k, s in stats.items()}
    assert all(s["error_rate"] == 0 for s in stats.values() if s["requests"]), errors

    # Three verdicts: each fault step with its before and after, and recovery checks after it.
    judged = [(j["step"], j["faults"], j["before"], j["after"]) for j in report["judged"]]
    assert judged == [(f, [f], b, a) for f, (b, a) in PLAN.items()], judged
    for fault, (_, after) in PLAN.items():
        checks = [c for c in report["checks"] if c["kind"] == "recovery" and c["judges"] == fault]
        assert {c["metric"] for c in checks} == {"ttfb_ms", "ttft_ms", "itl_ms"}, checks
        assert all(c["phase"] == after and c["passed"] for c in checks), checks
    gating = [c for c in report["checks"] if c["gating"]]
    assert gating and all(c["passed"] for c in gating), [c for c in gating if not c["passed"]]
    ttfb_slo = {c["phase"] for c in gating if c["kind"] == "slo" and c["metric"] == "ttfb_ms"}
    assert ttfb_slo == {s for pair in PLAN.values() for s in pair}, ttfb_slo

    # Each fault applied in its step and reverted; nothing left behind.
    records = {r["name"]: r for r in report["faults"]}
    assert sorted(records) == sorted(PLAN), report["faults"]
    for name, record in records.items():
        assert record["phase"] == name and record["error"] is None, record
        assert record["applied"] and record["reverted"], record
    kernel = json.dumps(records["jitter"]["applied"]["kernel"])
    assert "netem" in kernel and "htb" in kernel, kernel
    assert gpus.text() == original, gpus.text()
    assert _namespaces() == set()
    assert json.loads((state_dir / "journal.json").read_text()) == []
