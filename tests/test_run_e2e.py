"""The whole loop, for real: CLI -> embedded target -> SSE proxy -> Locust -> verdicts ->
reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_cmd, how_ended, reap, run_cli
from tests.timing import wait_until

SHORT = """
name: {name}
target:
  protocol: {protocol}
  embedded:
    ttft: 80ms
    itl: 10ms
    output_tokens: {{min: 30, max: 30}}
    seed: 3
    sse_event_ids: true
  timeout: 10s
load:
  users: 4
  think_time: {{min: 50ms, max: 100ms}}
  seed: 3
phases: {{warmup: 1s, baseline: 4s, fault: 4s, recovery: 4s}}
faults:
  - {{type: sse_proxy, name: chunk-drop, phase: fault, drop: 20%, first_event_delay: 300ms,
      seed: 3}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: {ttft_max}, phases: [baseline, recovery]}}
  - {{metric: chunk_loss, max: 2%, phases: [baseline, recovery]}}
  - {{metric: error_rate, max: 1%}}
"""


def _scenario(tmp_path: Path, **kw: object) -> Path:
    params = {"name": "short", "protocol": "openai", "ttft_max": 250, **kw}
    path = tmp_path / f"{params['name']}.yaml"
    path.write_text(SHORT.format(**params))
    return path


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _phase(report: dict, name: str) -> dict:
    return next(p for p in report["phases"] if p["name"] == name)


@pytest.mark.timeout(90)
def test_run_passes_shows_fault_damage_and_writes_reports(tmp_path: Path, state_dir: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("run", str(_scenario(tmp_path)), "--out", str(out), timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL SLOs MET" in proc.stdout
    report = _report(out)
    assert report["passed"] is True and report["interrupted"] is None
    base, fault, rec = (_phase(report, p) for p in ("baseline", "fault", "recovery"))
    assert base["stats"]["requests"] >= 10
    # The fault is visible where it lived, and only there.
    assert base["stats"]["chunk_loss"] == 0.0 and rec["stats"]["chunk_loss"] == 0.0
    assert 0.12 <= fault["stats"]["chunk_loss"] <= 0.28
    assert fault["stats"]["ttft_ms"]["p50"] >= base["stats"]["ttft_ms"]["p50"] + 250
    # Injected next to observed: the proxy's own counters come back in the fault timeline.
    (record,) = report["faults"]
    assert record["name"] == "chunk-drop" and record["error"] is None
    assert record["applied_at"] < record["reverted_at"]
    assert record["reverted"]["stats"]["events_dropped"] > 0
    # The fault-phase TTFT verdict is shown but does not gate.
    ttft_fault = [c for c in report["checks"] if c["metric"] == "ttft_ms" and c["phase"] == "fault"]
    assert ttft_fault and not ttft_fault[0]["gating"] and not ttft_fault[0]["passed"]
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == len(report["checks"])
    assert (out / "summary.md").read_text().startswith("## streamquake: short: ALL SLOs MET")


@pytest.mark.timeout(90)
def test_broken_slo_exits_1_and_junit_names_the_failure(tmp_path: Path, state_dir: Path) -> None:
    out = tmp_path / "out"
    scenario = _scenario(tmp_path, name="strict", protocol="gemini", ttft_max=20)
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=80)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SLO BROKEN" in proc.stdout
    report = _report(out)
    assert report["passed"] is False and report["exit_code"] == 1
    failures = ET.parse(out / "junit.xml").getroot().iter("failure")
    assert any("ttft_ms" in (f.get("message") or "") for f in failures)


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True)
    kids, frontier = [], {pid}
    while frontier:
        nxt = set()
        for line in out.stdout.splitlines():
            cpid, ppid, *_ = line.split(None, 2)
            if int(ppid) in frontier:
                nxt.add(int(cpid))
        kids += list(nxt)
        frontier = nxt
    return kids


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_fault_reverts_stops_children_and_reports_interrupted(
    tmp_path: Path, state_dir: Path, sig: signal.Signals, reaper: None
) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        cli_cmd("run", str(_scenario(tmp_path)), "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "STREAMQUAKE_STATE_DIR": str(state_dir)},
    )
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if "fault applied" in line:
            break
    else:
        proc.kill()
        pytest.fail("never reached the fault phase:\n" + "".join(seen))
    children = _children_of(proc.pid)
    assert children, "the run should have a target, a proxy and Locust running"
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    expected = 143 if sig == signal.SIGTERM else 130
    assert proc.returncode == expected, "".join(seen) + rest
    assert "fault reverted" in rest
    # The run stopped and reaped every child before it exited: none outlived it to be adopted
    # (and reaped) here, however long a busy machine took (the deadline is for a hang).
    ended: dict[int, int] = {}
    wait_until(lambda: reap(children, ended), f"children {children} of the run to end")
    assert ended == {}, f"children left behind, ended here: {how_ended(ended)}"
    report = _report(out)
    assert report["interrupted"] == sig.name and report["passed"] is False
    assert report["faults"][0]["reverted_at"] is not None
    assert not list(state_dir.glob("journal.json")) or json.loads(
        (state_dir / "journal.json").read_text()) == []
