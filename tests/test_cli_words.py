"""What an SRE trips over at the command line (issue 23): clean exits with one sentence, flags
shown as flags, units on every quantity. Every case goes through the real CLI."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

GOOD = REPO / "tests" / "scenarios" / "good_minimal.yaml"


def _one_sentence(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The command failed with ``code`` and said why in one line on stderr, naming ``words``."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "Traceback" not in out and "usage:" not in out.lower(), out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    for word in words:
        assert word in lines[0], out
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_a_scenario_file_that_cannot_be_read_writes_nothing(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    for path, words in ((tmp_path / "missing.yaml", ("missing.yaml", "no such file")),
                        (tmp_path, ("is a directory",)), (fifo, ("FIFO",))):
        # From another directory, whose ./out is the default --out: this checkout's package.
        proc = run_cli("run", str(path), cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
        _one_sentence(proc, 2, *words)
        assert proc.stdout == ""                         # no empty SLO table
        assert not (tmp_path / "out").exists()           # no reports for a run never begun
    # A file that was read but is wrong still gets its reports (the run's failure, recorded).
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nphases: {baseline: 1s}\n")
    proc = run_cli("run", str(bad), "--out", str(tmp_path / "bad-out"))
    assert proc.returncode == 2 and (tmp_path / "bad-out" / "report.json").is_file(), proc.stderr


@pytest.mark.timeout(120)
def test_every_bad_flag_is_one_sentence_naming_it_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = {
        ("run", str(GOOD), "--metrics-port", "99999"): ("--metrics-port 99999",),
        ("run", str(GOOD), "--workers", "banana"): ("--workers banana",),
        ("run", str(GOOD), "--remote-workers", "-1"): ("--remote-workers -1",),
        ("run", str(GOOD), "--master-bind", "nope:x"): ("--master-bind nope:x",),
        ("run", str(GOOD), "--lease", "soon"): ("--lease soon",),
        # --dry-run checks the flags it would run with
        ("run", str(GOOD), "--dry-run", "--workers", "banana"): ("--workers banana",),
        ("run", str(GOOD), "--dry-run", "--metrics-port", "-3"): ("--metrics-port -3",),
        ("target", "serve", "--protocol", "grpc"): ("--protocol grpc", "openai"),
        ("target", "serve", "--port", "99999"): ("--port 99999",),
        ("worker", "--master", "127.0.0.1:1", "--processes", "many"): ("--processes many",),
        ("worker", "--master", "127.0.0.1:1", "--connect-timeout", "0s"):
            ("--connect-timeout 0s",),
    }
    for args, words in cases.items():
        proc = run_cli(*args, "--out", str(out)) if args[0] == "run" else run_cli(*args)
        _one_sentence(proc, 2, *words)
        assert not out.exists(), args


@pytest.mark.timeout(60)
def test_help_lists_every_exit_code_and_shows_flags_bare() -> None:
    top = " ".join(run_cli("--help").stdout.split())
    assert "5 aborted" in top and "130/143 interrupted" in top
    for command in (("run",), ("validate",), ("inject",), ("revert",), ("faults",),
                    ("target", "serve"), ()):
        proc = run_cli(*command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "<bool>" not in proc.stdout, (command, proc.stdout)
        assert "--help" in proc.stdout
    assert "<path>" in run_cli("run", "--help").stdout        # options that take a value keep it


@pytest.mark.timeout(60)
def test_inject_a_tc_fault_without_target_is_a_usage_error(state_dir: Path) -> None:
    proc = run_cli("inject", "tbf", "rate=200kbit", "--for", "30s")
    _one_sentence(proc, 2, "--target HOST:PORT", "scope=interface")
    assert not (state_dir / "local-agent" / "local.json").exists()   # no agent was started


@pytest.mark.timeout(120)
def test_worker_gives_up_on_a_silent_master_after_connect_timeout() -> None:
    port = _free_port()          # nothing listens there on loopback
    proc = run_cli("worker", "--master", f"127.0.0.1:{port}", "--connect-timeout", "1s")
    _one_sentence(proc, 3, f"127.0.0.1:{port}", "within 1s", "--connect-timeout")
    assert "Failed to connect" not in proc.stdout + proc.stderr    # no Locust retry log
