"""Never leave a fault behind: a GPU clock lock (state that outlives processes, like the real
driver's) is reverted on success, SLO failure, a failed apply, Ctrl-C, SIGTERM, and, after a
SIGKILL, by `streamquake recover`. The real CLI runs against the emulated NVML driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_cmd
from tests.helpers import assert_run_ok, assert_verdict
from tests.nvml_shim import FakeGpus
from tests.timing import cli_start_s, recover_bound_s, wait_until

SCENARIO = """
name: gpu-lifecycle
target:
  protocol: anthropic
  embedded: {{ttft: 50ms, itl: 10ms, output_tokens: {{min: 20, max: 20}}, gpu_clock_scale: true}}
  timeout: 10s
load: {{users: 3, think_time: {{min: 50ms, max: 100ms}}}}
phases: {{warmup: 1s, baseline: 3s, fault: {fault_s}s, recovery: 3s}}
faults:
  - {{type: gpu_clocks, name: downclock, phase: fault, gpus: all, sm_clocks_mhz: [500, 800]}}
slos:
  - {{metric: itl_ms, percentile: 95, max: {itl_max}, phases: [baseline, recovery]}}
"""

LOCKED = "gpu0.sm_lock"


@pytest.fixture
def gpus(tmp_path: Path) -> FakeGpus:
    return FakeGpus(tmp_path / "nvml-state.txt", gpu_count=1)


def _env(gpus: FakeGpus, state_dir: Path) -> dict[str, str]:
    return gpus.env(STREAMQUAKE_STATE_DIR=str(state_dir))


def _scenario(tmp_path: Path, fault_s: float = 3, itl_max: float = 40) -> Path:
    path = tmp_path / "gpu.yaml"
    path.write_text(SCENARIO.format(fault_s=fault_s, itl_max=itl_max))
    return path


def _run(
    args: list[str], env: dict[str, str], timeout: float = 80
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_cmd(*args), env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _journal(state_dir: Path) -> list[dict]:
    path = state_dir / "journal.json"
    return json.loads(path.read_text()) if path.exists() else []


def _unlocked(gpus: FakeGpus, original: str) -> bool:
    return gpus.text() == original and LOCKED not in gpus.read()


@pytest.mark.timeout(90)
def test_success_path_reverts_and_records_telemetry(gpus: FakeGpus, tmp_path: Path) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    original = gpus.text()
    proc = _run(["run", str(_scenario(tmp_path)), "--out", str(out)], _env(gpus, state_dir))
    assert_run_ok(proc, out)
    assert _unlocked(gpus, original), gpus.text()
    assert _journal(state_dir) == []
    report = json.loads((out / "report.json").read_text())
    (fault,) = report["faults"]
    assert fault["applied"] and fault["reverted"] and fault["error"] is None
    samples = report["telemetry"]["gpu"]["samples"]
    fault_phase = next(p for p in report["phases"] if p["name"] == "fault")
    during = [s for s in samples if fault_phase["start"] + 0.5 < s["t"] < fault_phase["end"] - 0.5]
    assert during and all(s["sm_clock_mhz"] <= 800 for s in during)


@pytest.mark.timeout(120)
def test_shipped_gpu_downclock_scenario_breaks_only_in_the_fault_phase(
    gpus: FakeGpus, tmp_path: Path
) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    original = gpus.text()
    proc = _run(["run", "scenarios/gpu-downclock.yaml", "--out", str(out)],
                _env(gpus, state_dir), timeout=110)
    # A saturated fault step leaves its itl_ms check unjudged: exit 6, nothing broken.
    judged = assert_verdict(proc, 1, out, deciding={"itl_ms"})
    assert _unlocked(gpus, original)
    report = json.loads((out / "report.json").read_text())
    broken = {(c["metric"], c["phase"])
              for c in report["checks"] if c["gating"] and not c["passed"]}
    assert broken == ({("itl_ms", "fault")} if judged else set()), report["checks"]
    itl = {p["name"]: p["stats"]["itl_ms"]["p50"] for p in report["phases"]}
    assert itl["fault"] > 2.0 * itl["baseline"]      # 1980 MHz -> 800 MHz: ~2.5x slower
    assert itl["recovery"] < 1.2 * itl["baseline"]


@pytest.mark.timeout(60)
def test_failed_apply_exits_3_and_leaves_nothing(gpus: FakeGpus, tmp_path: Path) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    gpus.update({"fail.nvmlDeviceSetGpuLockedClocks": 4})      # NVML_ERROR_NO_PERMISSION
    original = gpus.text()
    proc = _run(["run", str(_scenario(tmp_path)), "--out", str(out)], _env(gpus, state_dir))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "root" in proc.stdout + proc.stderr
    assert _unlocked(gpus, original)
    assert _journal(state_dir) == []


def _start_and_wait_for_fault(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cli_cmd(*args), env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if "fault applied" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail("the run never applied its fault:\n" + "".join(seen))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_fault_reverts(
    gpus: FakeGpus, tmp_path: Path, sig: signal.Signals
) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    original = gpus.text()
    proc = _start_and_wait_for_fault(
        ["run", str(_scenario(tmp_path, fault_s=30)), "--out", str(out)], _env(gpus, state_dir))
    assert LOCKED in gpus.read()
    proc.send_signal(sig)
    time.sleep(0.05)
    proc.send_signal(sig)           # a second Ctrl-C must not cancel the revert
    proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else 143)
    assert _unlocked(gpus, original)
    assert _journal(state_dir) == []
    assert json.loads((out / "report.json").read_text())["interrupted"] == sig.name


@pytest.mark.timeout(120)
def test_sigkill_then_run_refuses_and_recover_restores(gpus: FakeGpus, tmp_path: Path) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    env = _env(gpus, state_dir)
    original = gpus.text()
    scenario = _scenario(tmp_path, fault_s=30)
    # Without the watchdog (or with it dead too): the journal and `recover` are what is left.
    proc = _start_and_wait_for_fault(["run", str(scenario), "--out", str(out), "--no-watchdog"],
                                     env)
    proc.kill()
    proc.communicate(timeout=30)
    assert LOCKED in gpus.read(), "a killed run leaves the lock behind, as the real driver would"
    (entry,) = _journal(state_dir)
    assert entry["type"] == "gpu_clocks" and entry["state"]

    refused = _run(["run", str(scenario), "--out", str(out), "--no-watchdog"], env)
    assert refused.returncode == 3
    assert "streamquake recover" in refused.stderr and "downclock" in refused.stderr

    recovered = _run(["recover"], env)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert "recovered downclock" in recovered.stdout
    assert _unlocked(gpus, original)
    assert _journal(state_dir) == []
    again = _run(["recover"], env)
    assert again.returncode == 0 and "nothing to recover" in again.stdout


LEASE_S = 2.0


def _wait_unlocked(gpus: FakeGpus, since: float, limit_s: float) -> float:
    """Seconds from ``since`` until the lock is gone (or ``limit_s`` if it never went)."""
    while LOCKED in gpus.read() and time.monotonic() - since < limit_s:
        time.sleep(0.05)
    return time.monotonic() - since


def _agent_log(state_dir: Path) -> str:
    path = state_dir / "local-agent" / "agent.log"
    return path.read_text() if path.exists() else "(no local agent log)"


@pytest.mark.timeout(90)
def test_the_watchdog_undoes_a_sigkilled_runs_fault_when_its_lease_lapses(
        gpus: FakeGpus, tmp_path: Path) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    original = gpus.text()
    proc = _start_and_wait_for_fault(
        ["run", str(_scenario(tmp_path, fault_s=30)), "--out", str(out),
         "--lease", f"{LEASE_S:g}s"], _env(gpus, state_dir))
    assert LOCKED in gpus.read()
    proc.kill()
    killed = time.monotonic()
    proc.communicate(timeout=30)
    took = _wait_unlocked(gpus, killed, 60)       # a deadline for a hang
    log = _agent_log(state_dir)
    assert _unlocked(gpus, original), f"still locked {took:.1f} s after the kill:\n{log}"
    # Nobody ran `recover`: the lock went when the lease ran out ("lapsed", below), not at the
    # kill (the last renewal was lease/5 before it, or somewhat more when a busy machine made
    # the renewing thread late), and not long after: late by less than half a lease, plus
    # what undoing the run's faults costs, the bound of `recover` itself measured here.
    bound = LEASE_S * 1.5 + recover_bound_s(cli_start_s(_env(gpus, state_dir)))
    assert LEASE_S * 0.5 <= took < bound, f"{took:.2f} s (bound {bound:.2f} s)\n{log}"
    # The agent says so, and updates the journal, once the undo has returned: just after the
    # lock went, a moment a busy machine can stretch.
    wait_until(lambda: _journal(state_dir) == []
               and "recovered downclock (gpu_clocks" in _agent_log(state_dir),
               f"the agent's journal and log after the undo:\n{_agent_log(state_dir)}")
    log = _agent_log(state_dir)
    assert "lease of run gpu-lifecycle" in log and "lapsed" in log


@pytest.mark.timeout(120)
def test_a_stopped_run_loses_its_faults_at_the_lease_and_says_so_when_it_wakes(
        gpus: FakeGpus, tmp_path: Path) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    original = gpus.text()
    proc = _start_and_wait_for_fault(
        ["run", str(_scenario(tmp_path, fault_s=20)), "--out", str(out),
         "--lease", f"{LEASE_S:g}s"], _env(gpus, state_dir))
    os.kill(proc.pid, signal.SIGSTOP)       # hung, not dead: no renewal, owner still alive
    stopped = time.monotonic()
    try:
        took = _wait_unlocked(gpus, stopped, 60)      # a deadline for a hang
        assert _unlocked(gpus, original), \
            f"still locked {took:.1f} s into the stop:\n{_agent_log(state_dir)}"
        assert proc.poll() is None, "the run was stopped, not killed"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 5, output     # aborted
    report = json.loads((out / "report.json").read_text())
    assert "lease lapsed" in report["aborted"] and "stopped" in report["aborted"]
    # Put down to this run's own lapsed lease, not to "another process" (that read exit 3).
    assert any("undone by the watchdog when this run's lease lapsed" in e
               for e in report["errors"]), report["errors"]
    assert _unlocked(gpus, original)
    assert _journal(state_dir) == []


SHORT = """
name: gpu-stopped
target:
  protocol: anthropic
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 10, max: 10}}
  timeout: 10s
load: {users: 2, think_time: {min: 50ms, max: 100ms}}
phases: {warmup: 0.5s, baseline: 1s, fault: 1s, recovery: 1s}
faults:
  - {type: gpu_clocks, name: downclock, phase: fault, gpus: all, sm_clocks_mhz: [500, 800]}
"""


def _start_and_wait_for(args: list[str], env: dict[str, str], line: str
                        ) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cli_cmd(*args), env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen.append(proc.stdout.readline())
        if line in seen[-1]:
            return proc
        if not seen[-1] and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"the run never said {line!r}:\n" + "".join(seen))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_at", ["phase baseline", "fault applied"])
def test_a_run_stopped_past_its_lease_and_its_end_exits_5_and_applies_nothing_late(
        gpus: FakeGpus, tmp_path: Path, stop_at: str) -> None:
    """Stopped just before its fault phase (or during it) and continued once both its lease
    and every phase are over: the run must not apply a fault on the lapsed lease (the walk used
    to apply and revert it in the same instant and exit 0), and a fault the watchdog undid is
    put down to this run's own lease (it used to read "another process", exit 3)."""
    state_dir, out = tmp_path / "state", tmp_path / "out"
    (tmp_path / "short.yaml").write_text(SHORT)
    original = gpus.text()
    proc = _start_and_wait_for(["run", str(tmp_path / "short.yaml"), "--out", str(out),
                                "--lease", f"{LEASE_S:g}s"], _env(gpus, state_dir), stop_at)
    os.kill(proc.pid, signal.SIGSTOP)
    seen = time.monotonic()
    try:
        # Continue once the watchdog has given up the lease and every phase's end has passed
        # (baseline, fault, recovery: 3 s from the line at most), so no tick runs after it.
        wait_until(lambda: "lapsed" in _agent_log(state_dir)
                   and "run gpu-stopped:" in _agent_log(state_dir)
                   and time.monotonic() - seen > 3.5, "the lease to lapse while stopped")
        assert proc.poll() is None, "the run was stopped, not killed"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 5, output     # aborted, never "ALL SLOs MET" nor "another process"
    report = json.loads((out / "report.json").read_text())
    assert "lease" in report["aborted"] and "lapsed" in report["aborted"], report["aborted"]
    if stop_at == "phase baseline":
        # Not applied: refused on the lapsed lease (or skipped, had a tick seen it first).
        assert all(f["applied_at"] is None for f in report["faults"]), report["faults"]
    else:
        (fault,) = report["faults"]
        assert "lease" in fault["error"], fault
    assert not any("another process" in e for e in report["errors"]), report["errors"]
    assert _unlocked(gpus, original)
    assert _journal(state_dir) == []
