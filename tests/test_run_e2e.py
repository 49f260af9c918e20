"""The whole loop, for real: CLI -> embedded target -> SSE proxy -> Locust -> verdicts ->
reports."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from streamquake.cli import KEPT_OUTPUT
from tests.conftest import REPO, cli_cmd, how_ended, reap, run_cli
from tests.helpers import assert_verdict
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
  - {{metric: ttft_ms, percentile: 95, max: {ttft_max}, phases: [{ttft_phases}]}}
  - {{metric: chunk_loss, max: 2%, phases: [recovery]}}
  - {{metric: error_rate, max: 1%}}
"""
# chunk_loss and (in the passing run) ttft_ms gate in recovery only: a baseline request still
# streaming when the drop fault begins loses chunks, and one still waiting for its first event
# gets the fault's 300 ms first-event delay; both count in baseline, where they were sent (every
# request is judged in its step). With ~36 baseline requests, two such make the p95 (seen in CI:
# baseline p95 382.5 ms against 87.7 ms in recovery). The baseline's loss is checked below to
# come from such requests alone.


def _scenario(tmp_path: Path, **kw: object) -> Path:
    params = {"name": "short", "protocol": "openai", "ttft_max": 250, "ttft_phases": "recovery",
              **kw}
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
    # Met, or not judged (exit 6, "NOT JUDGED") where a saturated step left its timings out.
    judged = assert_verdict(proc, 0, out)
    # Met; met as far as judged (a saturated step's non-gating timing left out, exit 0); or not
    # judged (a gating one left out, exit 6): the words the run uses for each.
    unjudged = [c for c in _report(out)["checks"] if c.get("ran", True) and c.get("not_judged")]
    word = ("NOT JUDGED" if not judged else "ALL JUDGED SLOs MET" if unjudged
            else "ALL SLOs MET")
    assert word in proc.stdout, proc.stdout[-3000:]
    report = _report(out)
    assert report["passed"] is judged and report["interrupted"] is None
    base, fault, rec = (_phase(report, p) for p in ("baseline", "fault", "recovery"))
    assert base["stats"]["requests"] >= 10
    # The fault is visible where it lived, and only there: in baseline only through requests
    # due there that ended in the fault step (each request counts where it was due, issue 30).
    assert base["stats"]["chunk_loss"] == 0.0 or base["stats"]["ended_after"].get("e2e_ms"), \
        base["stats"]
    assert rec["stats"]["chunk_loss"] == 0.0
    # Likewise the baseline's TTFT is the target's 80 ms, but for requests whose first event
    # came in the fault step (where judged: a saturated step's timings are not).
    assert not judged or base["stats"]["ttft_ms"]["p95"] <= 250 or \
        base["stats"]["ended_after"].get("ttft_ms"), base["stats"]
    assert 0.12 <= fault["stats"]["chunk_loss"] <= 0.28
    assert fault["stats"]["ttft_ms"]["p50"] >= base["stats"]["ttft_ms"]["p50"] + 250
    # Injected next to observed: the proxy's own counters come back in the fault timeline.
    (record,) = report["faults"]
    assert record["name"] == "chunk-drop" and record["error"] is None
    assert record["applied_at"] < record["reverted_at"]
    assert record["reverted"]["stats"]["events_dropped"] > 0
    # The fault-phase TTFT verdict is shown but does not gate.
    ttft_fault = [c for c in report["checks"] if c["metric"] == "ttft_ms" and c["phase"] == "fault"]
    # (Broken, unless a saturated fault step left it not judged: then it passes, not gating.)
    assert ttft_fault and not ttft_fault[0]["gating"], ttft_fault
    assert ttft_fault[0]["not_judged"] or not ttft_fault[0]["passed"], ttft_fault
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == len(report["checks"])
    assert (out / "summary.md").read_text().startswith(f"## streamquake: short: {word}")


@pytest.mark.timeout(90)
def test_broken_slo_exits_1_and_junit_names_the_failure(tmp_path: Path, state_dir: Path) -> None:
    out = tmp_path / "out"
    scenario = _scenario(tmp_path, name="strict", protocol="gemini", ttft_max=20,
                         ttft_phases="baseline, recovery")
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=80)
    # Broken, or (issue 30) not judged where a saturated step left its TTFT check unjudged.
    judged = assert_verdict(proc, 1, out, deciding={"ttft_ms"})
    report = _report(out)
    assert report["passed"] is False and report["exit_code"] == proc.returncode
    if not judged:
        return
    assert "SLO BROKEN" in proc.stdout
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


def _run_into_the_fault(tmp_path: Path, out: Path,
                        state_dir: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """A run of the short scenario, read until its fault is applied: the process and the lines
    it printed so far."""
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
            return proc, seen
    proc.kill()
    pytest.fail("never reached the fault phase:\n" + "".join(seen))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_fault_reverts_stops_children_and_reports_interrupted(
    tmp_path: Path, state_dir: Path, sig: signal.Signals, reaper: None
) -> None:
    out = tmp_path / "out"
    proc, seen = _run_into_the_fault(tmp_path, out, state_dir)
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


@pytest.mark.timeout(90)
def test_ctrl_c_after_its_reader_is_gone_still_reverts_and_reports(
        tmp_path: Path, state_dir: Path, reaper: None) -> None:
    """``run ... 2>&1 | tee log`` and Ctrl-C: tee dies with the run (one process group), so the
    run's next line meets a closed pipe. It used to end there, exit 1 with no report; now what
    it would print is dropped and it reverts, reports and exits 130 as without the pipe."""
    out = tmp_path / "out"
    proc, _ = _run_into_the_fault(tmp_path, out, state_dir)
    assert proc.stdout is not None
    proc.stdout.close()                  # the reader is gone: the next write meets EPIPE
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)
    # What it showed after its reader left is kept in the state directory, errors included.
    kept = state_dir / KEPT_OUTPUT
    shown = kept.read_text() if kept.exists() else "(nothing kept)"
    assert code == 130, shown
    assert "the reader of its output went away" in shown, shown
    assert "interrupted by SIGINT: faults reverted, writing a partial report" in shown, shown
    report = _report(out)
    assert report["interrupted"] == "SIGINT"
    assert report["faults"][0]["reverted_at"] is not None
    assert {"report.html", "junit.xml", "summary.md"} <= {p.name for p in out.iterdir()}
    assert not list(state_dir.glob("journal.json")) or json.loads(
        (state_dir / "journal.json").read_text()) == []


UP = """
name: up-first
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
load: {users: 4, workers: 2, think_time: {min: 50ms, max: 100ms}, seed: 3}
phases: {warmup: 0s, baseline: 3s, fault: 0s, recovery: 0s}
"""


@pytest.mark.timeout(90)
def test_the_first_step_opens_once_every_load_process_is_up(tmp_path: Path) -> None:
    """No lead guessed ahead: the runner sets the steps' times once Locust's master and its two
    workers each said they were up (and waited for their plan), half a second later; with no
    warm-up every worker's users send from the baseline's first moment and none before it."""
    scenario = tmp_path / "up.yaml"
    scenario.write_text(UP)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=80)
    assert_verdict(proc, 0, out)
    said = re.search(r"load generator: 3 Locust process\(es\) up in ([\d.]+) s; the first step "
                     r"opens 0.5 s after", proc.stdout)
    assert said, proc.stdout[-3000:]
    base = _phase(_report(out), "baseline")
    # Locust's master logs its run time once its init (which waits for the plan) is done, so
    # after the plan was written: the first step opens at most the 0.5 s after that (a fixed
    # lead ahead of the processes' start left 4-5 s here).
    log = (out / "run" / "locust.log").read_text()
    stamp = re.search(r"^\[([\d-]+ [\d:]+),(\d{3})\] [^\n]*Run time limit set", log, re.M)
    assert stamp, log[-2000:]
    logged = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + \
        int(stamp.group(2)) / 1000
    assert base["start"] - logged <= 0.5 + 0.002, (base["start"], stamp.group(0))
    files = sorted((out / "run" / "samples").glob("samples-*.jsonl"))
    sent = [[json.loads(line)["sent"] for line in f.read_text().splitlines()] for f in files]
    assert len(sent) == 2 and all(sent), files          # each worker's users sent requests
    first = min(min(s) for s in sent)
    assert base["start"] <= first < base["start"] + 0.2, (base["start"], first)
    assert not list((out / "run").glob("ready-*"))       # the handshake leaves no file


@pytest.mark.timeout(90)
def test_a_ramp_longer_than_the_start_up_keeps_its_spacing_from_the_first_step(
        tmp_path: Path) -> None:
    """8 users at 4 a second: Locust spawns them a second apart in two batches, the second
    after the first step opened (half a second after Locust was up). The whole ramp is shifted
    to the step's start, so the second batch starts a second after the first, not at once."""
    scenario = tmp_path / "ramp.yaml"
    scenario.write_text(UP.replace("users: 4, workers: 2,", "users: 8, spawn_rate: 4,")
                        .replace("min: 50ms, max: 100ms", "min: 9s, max: 9s"))
    out = tmp_path / "out"
    assert_verdict(run_cli("run", str(scenario), "--out", str(out), timeout=80), 0, out)
    base = _phase(_report(out), "baseline")
    sent = sorted(json.loads(line)["sent"] - base["start"]
                  for f in (out / "run" / "samples").glob("samples-*.jsonl")
                  for line in f.read_text().splitlines())
    assert len(sent) == 8, sent               # one request each: 9 s of thinking after it
    # Spawned late on a busy machine, a user starts later than its place, never earlier.
    assert 0 <= sent[0] < 0.2 and sent[-1] - sent[0] >= 0.9, sent
