"""Load from other hosts on Locust's own master/worker connection: `streamquake worker --master`
gets the plan from the run's master and sends every record back (loadgen/relay.py). A worker
in a namespace of its own joins over a veth pair, standing in for a second host; two workers
on loopback lose nothing at the end of the run (Locust's own count agrees with ours), and their
merged percentiles are those of the raw union; a worker SIGKILLed mid-run is reported."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamquake.faults.tc.netns import NamespaceTopology
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.scorecard import Scorecard
from streamquake.procs import read_listening_line, stop
from streamquake.run.scoring import score_samples
from streamquake.run.series import per_second
from streamquake.run.timeline import PhaseWindow
from streamquake.scenario.loader import load_scenario
from tests.conftest import REPO, cli_cmd, free_port
from tests.helpers import assert_run_ok
from tests.netns_fixtures import client_ns  # noqa: F401 - a fixture
from tests.timing import wait_until

SCENARIO = """
name: remote
target: {target}
load: {{users: 6, think_time: {{min: 50ms, max: 100ms}}}}
phases: {{warmup: 1s, baseline: {baseline}s, fault: 0s, recovery: 0s}}
"""
EMBEDDED = "{protocol: openai, embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 10, max: 10}}}"


def _worker(master: str, env: dict[str, str], netns: str | None = None,
            log: Path | None = None) -> subprocess.Popen[bytes]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    cmd = [*prefix, *cli_cmd("worker", "--master", master)]
    if log is None:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)
    with open(log, "wb") as out:       # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _run(args: list[str], env: dict[str, str], netns: str | None = None
         ) -> subprocess.Popen[str]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.Popen([*prefix, *cli_cmd("run", *args)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _samples(out: Path) -> dict[str, list[dict[str, object]]]:
    return {p.name: [json.loads(line) for line in p.read_text().splitlines() if line]
            for p in sorted((out / "run" / "samples").glob("samples-*.jsonl"))}


def _sent_by(out: Path, worker: str) -> bool:
    """Whether records of ``worker`` (w0, w1) have reached the master's samples."""
    path = out / "run" / "samples" / f"samples-{worker}.jsonl"
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _locust_count(out: Path) -> int:
    """Locust's own total of SSE requests, from the master's summary (one per sample)."""
    for line in (out / "run" / "locust.log").read_text().splitlines():
        parts = line.split()
        if parts[:2] == ["SSE", "default"] and len(parts) > 2 and parts[2].isdigit():
            return int(parts[2])
    raise AssertionError("no SSE line in the master's Locust summary")


def _nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@pytest.fixture
def env(state_dir: Path) -> Iterator[dict[str, str]]:
    yield {**os.environ, "STREAMQUAKE_STATE_DIR": str(state_dir)}


@pytest.mark.timeout(120)
def test_two_remote_workers_lose_nothing_and_merge_exactly(tmp_path: Path,
                                                          env: dict[str, str]) -> None:
    port = free_port()
    scenario = tmp_path / "s.yaml"
    # 10 s: a second is relayed as a line only once a checkpoint (every 2 s) finds it 3 s past
    # (loadgen/scorecard.py); at 4 s, with busy loops on every core, the workers' first
    # requests came 2 s in and the run ended before any second was that old.
    scenario.write_text(SCENARIO.format(target=EMBEDDED, baseline=10))
    out = tmp_path / "out"
    run = _run([str(scenario), "--out", str(out), "--remote-workers", "2",
                "--master-bind", f"127.0.0.1:{port}"], env)
    workers = [_worker(f"127.0.0.1:{port}", env, log=tmp_path / f"w{i}.log") for i in (1, 2)]
    output, _ = run.communicate(timeout=100)
    for w in workers:
        w.wait(timeout=30)
    assert_run_ok(run, out, said=output)
    assert [w.returncode for w in workers] == [0, 0], [
        (tmp_path / f"w{i}.log").read_text()[-2000:] for i in (1, 2)]

    files = _samples(out)
    assert sorted(files) == ["samples-w0.jsonl", "samples-w1.jsonl"]
    assert all(len(rows) > 10 for rows in files.values()), {k: len(v) for k, v in files.items()}
    everything = [s for rows in files.values() for s in rows]
    # Streams still in flight at the end were sent before the workers said they stopped.
    assert _locust_count(out) == len(everything)

    report = json.loads((out / "report.json").read_text())
    procs = report["load_processes"]
    assert [(p["index"], p["remote"], p["users"]) for p in procs] == [(0, True, 3), (1, True, 3)]
    assert all(abs(p["clock_skew_s"]) < 0.1 for p in procs)
    baseline = next(p for p in report["phases"] if p["name"] == "baseline")
    window = (baseline["start"], baseline["end"])
    # Every request sent in the step counts there, however late its first token came.
    ttft = [float(s["ttft_ms"]) for s in everything  # type: ignore[arg-type]
            if window[0] <= float(s["sent"]) < window[1]  # type: ignore[arg-type]
            and s["ttft_ms"] is not None]
    stats = baseline["stats"]
    assert stats["ttft_ms"]["count"] == len(ttft)
    # The report comes from the workers' scorecards (sent as custom messages), not the lines:
    # every figure of every phase equals the one scored from the raw union.
    cards = sorted(p.name for p in (out / "run" / "scorecards").glob("scorecard-*.json"))
    assert cards == ["scorecard-w0.json", "scorecard-w1.json"]
    windows = [PhaseWindow(p["name"], p["start"], p["end"]) for p in report["phases"]]
    union = score_samples(load_scenario(scenario), windows,
                          [RequestSample.from_dict(s) for s in everything])
    for phase, raw in zip(report["phases"], union.phases, strict=True):
        assert {k: phase["stats"][k] for k in raw.stats} == raw.stats, phase["name"]
    # The timeline too: its seconds were relayed as lines (seconds-w<i>.jsonl).
    timeline = per_second(Scorecard.of(windows, [RequestSample.from_dict(s) for s in everything]),
                          windows)
    assert [(p["sent"], p["errors"], p["in_flight"], p["n"], p["p95"])
            for p in report["timeline"]] == [(p.sent, p.errors, p.in_flight, p.n, p.p95)
                                             for p in timeline]
    assert sorted(p.name for p in (out / "run" / "scorecards").glob("seconds-*.jsonl")) == \
        ["seconds-w0.jsonl", "seconds-w1.jsonl"]
    for p in (50, 95, 99):
        # The report's histogram keeps 4 significant digits: equal to the raw union's value
        # within that precision.
        merged = stats["ttft_ms"][f"p{p:g}"]
        assert merged == pytest.approx(_nearest_rank(ttft, p), rel=1e-3, abs=0.01), p


@pytest.mark.timeout(150)
@pytest.mark.netns
def test_a_worker_in_another_namespace_joins_over_veth(
        tmp_path: Path, env: dict[str, str], client_ns: str) -> None:  # noqa: F811
    with NamespaceTopology(host_netns=client_ns) as topo:
        # The master and the target on the "first host" (client_ns), at the veth's near end;
        # the worker on the "second host" (topo.netns) reaches both only over the veth pair.
        config = tmp_path / "target.yaml"
        config.write_text("ttft: 20ms\nitl: 5ms\noutput_tokens: {min: 10, max: 10}\n")
        target = subprocess.Popen(
            ["ip", "netns", "exec", client_ns, *cli_cmd(
                "target", "serve", "--protocol", "openai", "--host", topo.host_addr,
                "--port", "0", "--config", str(config))],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            url = read_listening_line(target, 20, "target")
            scenario = tmp_path / "s.yaml"
            scenario.write_text(SCENARIO.format(
                target=f"{{protocol: openai, url: '{url}'}}", baseline=4))
            out = tmp_path / "out"
            run = _run([str(scenario), "--out", str(out), "--remote-workers", "1",
                        "--master-bind", f"{topo.host_addr}:5557"], env, netns=client_ns)
            worker = _worker(f"{topo.host_addr}:5557", env, netns=topo.netns,
                             log=tmp_path / "worker.log")
            output, _ = run.communicate(timeout=120)
            worker.wait(timeout=30)
        finally:
            assert target.stdout is not None
            target.stdout.close()
            stop(target)
        assert_run_ok(run, out, said=output + (tmp_path / "worker.log").read_text())
        report = json.loads((out / "report.json").read_text())
        (proc,) = report["load_processes"]
        assert proc["remote"] and proc["users"] == 6
        baseline = next(p for p in report["phases"] if p["name"] == "baseline")
        assert baseline["stats"]["requests"] > 20 and baseline["stats"]["error_rate"] == 0
        assert list(_samples(out)) == ["samples-w0.jsonl"]
        assert "load plan received from the master" in (tmp_path / "worker.log").read_text()


@pytest.mark.timeout(150)
def test_a_worker_killed_mid_run_is_reported(tmp_path: Path, env: dict[str, str]) -> None:
    port = free_port()
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.format(target=EMBEDDED, baseline=10))
    out = tmp_path / "out"
    run = _run([str(scenario), "--out", str(out), "--remote-workers", "2",
                "--master-bind", f"127.0.0.1:{port}"], env)
    workers = [_worker(f"127.0.0.1:{port}", env) for _ in (1, 2)]
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stdout or []), daemon=True)
    reader.start()
    # In the baseline, with both workers sending: polled for, however long a busy machine
    # takes to get there (the deadline is for a hang).
    wait_until(lambda: any("phase baseline" in ln for ln in list(lines))
               and all(_sent_by(out, w) for w in ("w0", "w1")),
               "the baseline phase with records from both workers", timeout_s=120)
    os.killpg(workers[0].pid, signal.SIGKILL)
    killed_at = time.time()
    workers[0].wait(timeout=10)
    run.wait(timeout=180)
    reader.join(timeout=30)
    if run.stdout is not None:
        run.stdout.close()
    output = "".join(lines)
    workers[1].wait(timeout=30)
    assert_run_ok(run, out, said=output)
    report = json.loads((out / "report.json").read_text())
    missing = [p for p in report["load_processes"] if p["missing_at"] is not None]
    assert len(missing) == 1 and missing[0]["missing_at"] >= killed_at
    (said,) = [e for e in report["errors"] if "went missing" in e]
    assert "baseline phase" in said and "3 of 6 users" in said and "50% less load" in said
    assert "went missing" in output


@pytest.mark.timeout(60)
def test_workers_elsewhere_cannot_reach_this_hosts_loopback(tmp_path: Path,
                                                            env: dict[str, str]) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.format(target=EMBEDDED, baseline=2))
    run = _run([str(scenario), "--out", str(tmp_path / "out"), "--remote-workers", "1",
                "--master-bind", f"0.0.0.0:{free_port()}"], env)
    output, _ = run.communicate(timeout=50)
    assert run.returncode == 3, output[-2000:]
    assert "workers on other hosts would send to http://127.0.0.1:" in output
    assert "give target.url an address they can reach" in output
    assert not (tmp_path / "out" / "run" / "locust.log").exists()    # nothing was started
