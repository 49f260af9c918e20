"""Exit codes and secrets, through the real CLI."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import assert_run_ok


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(30)
def test_unreachable_target_is_a_preflight_error(tmp_path: Path, state_dir: Path) -> None:
    scenario = tmp_path / "remote.yaml"
    scenario.write_text(f"""
name: remote
target: {{protocol: openai, url: "http://127.0.0.1:{_closed_port()}", connect_timeout: 2s}}
phases: {{baseline: 1s, fault: 0s, recovery: 0s}}
""")
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "is unreachable" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(30)
def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert run_cli("run").returncode == 2
    assert run_cli("frobnicate").returncode == 2
    proc = run_cli("run", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "cannot read the scenario file" in proc.stderr


@pytest.mark.timeout(30)
def test_help_documents_exit_codes() -> None:
    proc = run_cli("run", "--help")
    assert proc.returncode == 0
    fragments = ("0 all SLOs met", "1 an SLO broken", "2 scenario", "3 environment", "4 a fault")
    for fragment in fragments:
        assert fragment in " ".join(proc.stdout.split())


@pytest.mark.timeout(60)
def test_secrets_never_reach_output_or_reports(tmp_path: Path, state_dir: Path) -> None:
    secret = "sk-live-5f3c9a1e-do-not-print"
    scenario = tmp_path / "secret.yaml"
    scenario.write_text("""
name: secret
target:
  protocol: anthropic
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
  headers: {x-api-key: "${SQ_TEST_API_KEY}", Authorization: "Bearer ${SQ_TEST_API_KEY}"}
load: {users: 2, think_time: {min: 50ms, max: 50ms}}
phases: {warmup: 2s, baseline: 2s, fault: 0s, recovery: 0s}
slos: [{metric: error_rate, max: 0%}]
""")
    # The warm-up: on a busy machine Locust took over 2 s to start, and a baseline of its own
    # sent nothing (no data: error_rate broken).
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), env={"SQ_TEST_API_KEY": secret})
    assert_run_ok(proc, out)
    assert secret not in proc.stdout + proc.stderr
    for path in out.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert '"x-api-key": "<redacted>"' in (out / "report.json").read_text()


@pytest.mark.timeout(60)
def test_missing_secret_variable_is_named_not_crashed(tmp_path: Path, state_dir: Path) -> None:
    scenario = tmp_path / "nosecret.yaml"
    scenario.write_text("""
name: nosecret
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 5ms}
  headers: {Authorization: "Bearer ${SQ_TEST_UNSET_KEY}"}
phases: {baseline: 2s, fault: 0s, recovery: 0s}
""")
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "SQ_TEST_UNSET_KEY" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.timeout(30)
def test_target_serve_streams_the_chosen_protocol_only(tmp_path: Path) -> None:
    import http.client
    import json
    import subprocess

    from streamquake.procs import read_listening_line, stop
    from tests.conftest import REPO, cli_cmd

    config = tmp_path / "target.yaml"
    config.write_text("ttft: 10ms\nitl: 1ms\noutput_tokens: {min: 3, max: 3}\n")
    proc = subprocess.Popen(
        cli_cmd("target", "serve", "--protocol", "openai", "--port", "0", "--config", str(config)),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        url = read_listening_line(proc, 15, "target")
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == 200 and text.rstrip().endswith("data: [DONE]")
        deltas = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        content = [d for d in deltas if d["choices"] and d["choices"][0]["delta"].get("content")]
        assert len(content) == 3
        conn.request("POST", "/v1/messages", json.dumps({"stream": True}),
                     {"Content-Type": "application/json"})
        other = conn.getresponse()
        other.read()
        conn.close()
        assert other.status == 404
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
        stop(proc)
