"""What a game day watches: the live view (a real pseudo-terminal, and plain lines in a log) and
abort conditions, which revert the faults the moment the damage is too much, let recovery run,
and say why."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

from streamquake.errors import EXIT_NOT_JUDGED
from tests.conftest import REPO, cli_cmd, run_cli
from tests.helpers import assert_run_ok

ABORTING = """
name: abort-on-errors
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
load: {users: 4, think_time: {min: 20ms, max: 50ms}}
phases: {warmup: 4s, baseline: 3s, fault: 20s, recovery: 3s}
faults:
  - {type: sse_proxy, name: outage, phase: fault, abort: {status: 503, probability: 100%}}
abort_when:
  - {metric: error_rate, above: 50%, for: 2s}
slos:
  - {metric: error_rate, max: 1%, phases: [baseline, recovery]}
"""

QUIET = """
name: live
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
load: {users: 2, think_time: {min: 50ms, max: 100ms}}
phases: {warmup: 4s, baseline: 3s, fault: 2s, recovery: 2s}
faults:
  - {type: sse_proxy, name: slow, phase: fault, delay: 5ms}
slos:
  - {metric: ttft_ms, percentile: 95, max: 500}
"""


@pytest.mark.timeout(120)
def test_an_abort_condition_reverts_at_once_and_recovery_still_runs(tmp_path: Path) -> None:
    scenario, out = tmp_path / "abort.yaml", tmp_path / "out"
    scenario.write_text(ABORTING)
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=110)
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "ABORTED in fault: abort condition 'error_rate above 50% for 2s' held" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["aborted"].startswith("abort condition 'error_rate above 50% for 2s' held")
    assert any(e.startswith("run aborted: ") for e in report["errors"])
    (record,) = report["faults"]
    fault = next(p for p in report["phases"] if p["name"] == "fault")
    # Reverted within seconds of the damage, long before the 20 s phase would have ended it.
    assert record["reverted_at"] - record["applied_at"] < 8, record
    assert record["reverted_at"] < fault["end"] - 10
    recovery = next(p for p in report["phases"] if p["name"] == "recovery")
    assert recovery["stats"]["requests"] > 10 and recovery["stats"]["error_rate"] == 0.0


@pytest.mark.timeout(90)
def test_the_live_view_in_a_terminal_and_as_plain_lines(tmp_path: Path) -> None:
    scenario, out = tmp_path / "live.yaml", tmp_path / "out"
    scenario.write_text(QUIET)
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "50"}
    pid, fd = pty.fork()
    if pid == 0:                                  # the child: the CLI on a pseudo-terminal
        os.chdir(REPO)
        cmd = cli_cmd("run", str(scenario), "--out", str(out))
        os.execvpe(cmd[0], cmd, env)
    screen = b""
    deadline = time.monotonic() + 80
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:                           # EIO: the child closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    _, status = os.waitpid(pid, 0)
    text = screen.decode(errors="replace")
    # 0, or 6 where a saturated step left the TTFT SLO unjudged: this test is about the view.
    assert os.WEXITSTATUS(status) in (0, EXIT_NOT_JUDGED), text[-3000:]
    for phase in ("baseline", "fault", "recovery"):
        assert f"phase {phase} · " in text, text[-3000:]
    assert "s left" in text and "p95 ms" in text and "requests/s" in text
    assert "slow (sse_proxy)" in text                  # the active fault, while it was on
    assert "ttft_ms p95 <= 500" in text                # the SLO light's row

    # Not a terminal (a CI log): plain periodic lines instead of the panel.
    plain = subprocess.run(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out2")),
                           cwd=REPO, capture_output=True, text=True, timeout=80)
    assert_run_ok(plain, tmp_path / "out2")
    lines = [ln for ln in plain.stdout.splitlines() if ln.startswith("live: phase ")]
    assert lines, plain.stdout
    assert "req/s" in lines[-1] and "TTFT p50" in lines[-1] and "(n=" in lines[-1]
