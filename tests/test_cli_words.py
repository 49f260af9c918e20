"""What an SRE trips over at the command line (issue 23): clean exits with one sentence, flags
shown as flags, units on every quantity. Every case goes through the real CLI."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, run_cli
from tests.helpers import assert_run_ok

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
    port = free_port()          # nothing listens there on loopback
    proc = run_cli("worker", "--master", f"127.0.0.1:{port}", "--connect-timeout", "1s")
    _one_sentence(proc, 3, f"127.0.0.1:{port}", "within 1s", "--connect-timeout")
    assert "Failed to connect" not in proc.stdout + proc.stderr    # no Locust retry log


LIVE = """
name: words
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
load: {users: 2, think_time: {min: 50ms, max: 100ms}}
phases: {warmup: 1s, baseline: 4s, fault: 6s, recovery: 8s}
faults:
  - {type: sse_proxy, name: slow-start, phase: fault, first_event_delay: 400ms}
slos:
  - {metric: ttft_ms, percentile: 95, max: 10s}
  - {metric: error_rate, max: 1%}
  - {metric: ttfb_ms, percentile: 99, max: 350ms, phases: [baseline]}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One real run, its output piped (a CI log): a 400 ms first-event delay in fault only."""
    root = tmp_path_factory.mktemp("words")
    (root / "words.yaml").write_text(LIVE)
    proc = run_cli("run", str(root / "words.yaml"), "--out", str(root / "out"), timeout=200,
                   env={"STREAMQUAKE_STATE_DIR": str(root / "state")})
    assert_run_ok(proc, root / "out")
    return proc, root / "out"


def _live(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith("live: ")]


def _ttft_p95(line: str) -> tuple[float | None, int]:
    """The TTFT p95 (ms) and its count in a live line: ``TTFT p50 20.1 p95 22.3 (n=40)``."""
    m = re.search(r"TTFT p50 \S+ p95 (\S+) \(n=(\d+)\)", line)
    assert m, line
    return (None if m[1] == "-" else float(m[1])), int(m[2])


@pytest.mark.timeout(240)
def test_live_lines_say_starting_and_never_reach_back_across_a_phase_edge(
        run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    lines = _live(run[0].stdout)
    assert lines[0].startswith("live: starting, warmup in "), lines[0]
    assert not any("None" in ln for ln in lines), lines
    fault = [p for ln in lines if ln.startswith("live: phase fault ")
             for p, n in [_ttft_p95(ln)] if n and p is not None]
    recovery = [(p, n) for ln in lines if ln.startswith("live: phase recovery ")
                for p, n in [_ttft_p95(ln)] if n]
    assert fault and recovery, lines
    # Recovery's window holds recovery's requests only: none slowed by the fault before it.
    assert all(p is not None and p < max(fault) / 2 for p, _ in recovery), (fault, recovery)


@pytest.mark.timeout(240)
def test_every_quantity_in_its_unit_and_the_question_mark_explained(
        run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = run
    summary = (out / "summary.md").read_text()
    check = next(c for c in json.loads((out / "report.json").read_text())["checks"]
                 if c["name"].startswith("ttfb_ms p99") and c["phase"] == "baseline")
    for text in (proc.stdout, summary):
        assert "ttft_ms p95 <= 10s" in text and "error_rate <= 1%" in text, text
        assert "<= 10000" not in text and "<= 0.01" not in text
        if check["not_judged"]:
            # A saturated baseline (a busy machine): not judged, in its unit, and said why.
            legend = [ln for ln in text.splitlines() if ln.startswith("not judged, the load")]
            assert len(legend) == 1 and "ttfb_ms p99 in baseline" in legend[0], text
            assert re.search(r"ttfb_ms p99 <= 350ms\s+\S\s+[\d.]+ ms (~|not judged)", text), text
            continue
        # Few baseline values: p99 cannot be bounded from above, and the legend says so.
        legend = [ln for ln in text.splitlines() if ln.startswith("? inconclusive")]
        assert len(legend) == 1, text
        assert re.search(r"ttfb_ms p99 in baseline \(n=\d+[^)]*\)[^;]*: p99 needs at least "
                         r"368 values to be bounded", legend[0]), legend[0]
    if check["not_judged"]:
        return
    verdict_rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("│ ttfb_ms p99")]
    assert len(verdict_rows) == 1 and " ms ?" in verdict_rows[0], verdict_rows
    assert check["inconclusive"] and check["samples"] < 368 and check["samples_needed"] == 368


@pytest.mark.timeout(240)
def test_a_fault_applied_is_one_line_in_its_units_with_the_record_in_the_report(
        run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = run
    (line,) = [ln for ln in proc.stdout.splitlines() if "fault applied" in ln]
    assert re.search(r"fault applied slow-start \(sse_proxy\): first_event_delay=400ms, "
                     r"in place in \d+ ms$", line), line
    (record,) = json.loads((out / "report.json").read_text())["faults"]
    assert record["applied"] and record["settings"] == "first_event_delay=400ms"


@pytest.mark.timeout(60)
def test_dry_run_says_each_setting_in_its_unit(tmp_path: Path) -> None:
    scenario = tmp_path / "units.yaml"
    scenario.write_text("""
name: units
target: {protocol: openai, url: "http://127.0.0.1:9"}
phases: {baseline: 5s, fault: 5s, recovery: 5s}
faults:
  - {type: tbf, name: thin, rate: 200kbit, burst: 4kb, latency: 1.5s}
  - {type: sse_proxy, name: late, phase: recovery, first_event_delay: 400ms, drop: 15%,
     stall: {probability: 1%, duration: 2s}}
""")
    proc = run_cli("run", str(scenario), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "(rate=200kbit, burst=4kb, latency=1.5s" in proc.stdout, proc.stdout
    assert "drop=15%" in proc.stdout and "first_event_delay=400ms" in proc.stdout
    assert "stall.probability=1%, stall.duration=2s" in proc.stdout
    assert "25000" not in proc.stdout and "400.0" not in proc.stdout
    assert "drop_usage" not in proc.stdout     # a switch left off says nothing


@pytest.mark.timeout(60)
def test_faults_says_each_note_once_describes_every_parameter_and_keeps_width_piped() -> None:
    proc = run_cli("faults", env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("1.5s, 1m30s") == 1 and proc.stdout.count("15% or 0.15") == 1
    rows = [ln for ln in proc.stdout.splitlines() if "│" in ln]
    # One row a parameter: piped, no cell wraps onto a line of its own.
    assert not [r for r in rows if not r.split("│")[0].strip()], rows
    docs = json.loads(run_cli("faults", "--json").stdout)
    bare = [(d["type"], p["name"]) for d in docs for p in d["params"] if not p["description"]]
    assert bare == [], bare


@pytest.mark.timeout(30)
def test_every_imported_package_is_declared() -> None:
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    declared = {norm(re.split(r"[<>=!~\[; ]", d)[0]) for d in tomllib.loads(
        (REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    owners = packages_distributions()
    imported: dict[str, str] = {}
    for path in (REPO / "streamquake").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and not node.level else [])
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names):
                imported.setdefault(top, str(path.relative_to(REPO)))
    imported.pop("streamquake")
    undeclared = {m: where for m, where in imported.items()
                  if not {norm(d) for d in owners.get(m, [m])} & declared}
    assert undeclared == {}, undeclared
