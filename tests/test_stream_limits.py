"""Concurrency sizing before any load (issue 24): what a scenario's concurrent streams need of
this host (file descriptors of the load process and the embedded target, ephemeral ports to one
address), said in one sentence with its fix before anything starts; the soft open-files limit
raised to the hard one where the streams need it."""

from __future__ import annotations

import json
import os
import resource
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from streamquake.errors import EXIT_ENVIRONMENT
from streamquake.run.stream_limits import PORT_RANGE, stream_limits_check
from streamquake.scenario import parse_scenario
from tests.conftest import REPO, cli_cmd
from tests.helpers import assert_run_ok

USERS = 300


def _scenario(users: int) -> str:
    return json.dumps({
        "name": "capacity",
        "target": {"protocol": "openai", "timeout": "30s", "probe": False, "embedded": {
            "ttft": "10ms", "itl": "50ms", "output_tokens": {"min": 20, "max": 20},
            "capacity": 2 * users}},
        "load": {"users": users, "spawn_rate": users, "samples": "none"},
        # A warm-up of 5 s: on a busy machine Locust began 3-4 s late (no data in baseline).
        "phases": {"warmup": "5s", "baseline": "3s", "fault": "0s", "recovery": "0s"},
        "slos": [{"metric": "error_rate", "max": "50%"}],
    })


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return limit


def _run(tmp_path: Path, soft: int, hard: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    spec = tmp_path / "s.yaml"
    spec.write_text(_scenario(USERS))
    out = tmp_path / "out"
    proc = subprocess.run([*cli_cmd("run", str(spec), "--out", str(out), "--no-watchdog")],
                          capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=dict(os.environ), preexec_fn=_nofile(soft, hard))
    return proc, out


@pytest.mark.timeout(300)
def test_too_few_file_descriptors_are_one_sentence_before_any_load(tmp_path: Path) -> None:
    proc, out = _run(tmp_path, 128, 128)
    text = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_ENVIRONMENT, text
    assert "Traceback" not in text, text
    assert (f"{USERS} concurrent streams will not fit: file descriptors of each load process "
            "run out first, at about 64 streams") in text, text
    assert "ulimit -n" in text, text
    # Said before anything started: no target, no Locust.
    assert "starting the embedded target" not in text, text
    assert not (out / "run" / "locust.log").exists()


@pytest.mark.timeout(300)
def test_the_soft_limit_is_raised_to_the_hard_one_and_every_stream_opens(
        tmp_path: Path) -> None:
    # A soft limit under the streams, a hard one above: without raising it, the target and the
    # load process fail their streams with "Too many open files".
    proc, out = _run(tmp_path, 128, 4096)
    text = proc.stdout + proc.stderr
    assert_run_ok(proc, out)
    assert f"capacity: {USERS} concurrent streams need" in text, text
    report = json.loads((out / "report.json").read_text())
    base = next(p for p in report["phases"] if p["name"] == "baseline")
    assert base["stats"]["requests"] > 0, base["stats"]
    assert sum(base["stats"]["errors"].values()) == 0, base["stats"]["errors"]


def test_ephemeral_ports_are_named_when_they_run_out_first() -> None:
    low, high = (int(x) for x in PORT_RANGE.read_text().split())
    ports = high - low + 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    workers = max(1, -(-(ports + 1) // max(1, soft - 200)))
    scenario = parse_scenario(json.dumps({
        "name": "ports", "target": {"protocol": "openai", "url": "http://127.0.0.1:9"},
        "load": {"users": ports + 1, "workers": workers},
        "phases": {"baseline": "1s", "fault": "0s", "recovery": "0s"},
    }))
    problems, sentence = stream_limits_check(scenario)
    assert problems == [
        f"{ports + 1:,} concurrent streams will not fit: ephemeral ports run out first, at "
        f"about {ports:,} streams: they need {ports + 1:,} local ports to one address "
        f"({ports:,} in net.ipv4.ip_local_port_range, {low}-{high}); widen "
        "net.ipv4.ip_local_port_range (`sysctl -w "
        "net.ipv4.ip_local_port_range='1024 65535'`)"], (problems, soft, hard)
    assert sentence.endswith(f"the first to run out would be ephemeral ports, at about "
                             f"{ports:,} streams")


def test_a_step_with_more_users_than_the_scenario_is_what_is_sized() -> None:
    from streamquake.run.stream_limits import concurrent_streams
    from streamquake.scenario import parse_scenario

    scenario = parse_scenario("""
name: steps-users
target: {protocol: openai, embedded: {}}
load: {users: 4}
steps:
  - {name: base, kind: baseline, duration: 3s}
  - {name: crowd, kind: baseline, duration: 3s, load: {users: 400}}
""", "s.yaml")
    assert concurrent_streams(scenario) == 400
