"""The history store: a SIGKILL in the middle of appends leaves it intact with every committed
run whole; `streamquake history` over real runs flags the run whose target got slower, by
compare's own interval test (the same verdicts as `compare` on the same runs), judges only with
enough earlier runs, ignores moves within the scenario's slack, and refuses options that would
silently mean something else."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.report_runs import Runs, report_runs


@pytest.fixture(scope="module")
def runs() -> Runs:
    return report_runs()


APPENDER = r"""
import sys, time
from pathlib import Path
from streamquake.reports.history import append_run
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.result import PhaseResult, RunResult

samples = [RequestSample(cls="c", sent=1.0 + i, ttfb_ms=5.0 + i, ttft_ms=80.0 + i,
                         e2e_ms=400.0 + i, itl_ms=[10.0] * 20, output_tokens=21)
           for i in range(50)]
stats = Stats.from_samples(samples).to_dict()
path = Path(sys.argv[1])
i = 0
while True:
    result = RunResult(f"kill-{i % 3}", "k.yaml", {}, "0", time.time(), time.time(), None,
                       [PhaseResult(p, 0.0, 1.0, dict(stats)) for p in
                        ("baseline", "fault", "recovery")], [], [], {},
                       environment={"scenario_sha256": "x", "host": "h"})
    run_id = append_run(path, result, Path("/nowhere/report.json"))
    print(run_id, flush=True)
    i += 1
"""


@pytest.mark.timeout(90)
def test_sigkill_mid_append_leaves_the_store_intact(tmp_path: Path) -> None:
    store = tmp_path / "history.sqlite"
    committed: list[int] = []
    for round_ in range(3):          # kill it three times, at different moments
        proc = subprocess.Popen([sys.executable, "-c", APPENDER, str(store)],
                                stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert proc.stdout is not None
        target = len(committed) + 20 + 7 * round_
        while len(committed) < target:
            line = proc.stdout.readline()
            assert line, "the appender died on its own"
            committed.append(int(line))
        time.sleep(0.003 * round_)   # let it get into the next append
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        committed += [int(line) for line in proc.stdout.read().split()]   # still in the pipe
        proc.stdout.close()
        with sqlite3.connect(store) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            ids = [r[0] for r in db.execute("SELECT id FROM runs ORDER BY id")]
            assert set(committed) <= set(ids)
            # At most the one append in flight may have committed after its last print.
            assert len(ids) - len(committed) in (0, 1)
            committed = ids
            # Every run is whole: as many metric rows as it recorded, never half a run.
            for run_id, n in db.execute("SELECT id, n_metrics FROM runs"):
                (got,) = db.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ?",
                                    (run_id,)).fetchone()
                assert got == n > 0
    from streamquake.reports.history import read_runs

    assert [r.id for r in read_runs(store)] == committed
    proc = run_cli("history", str(store), "--scenario", "kill-0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kill-0" in proc.stdout and "no regression beyond max(10%" in proc.stdout


@pytest.mark.timeout(240)
def test_history_flags_the_run_that_got_slower(runs: Runs) -> None:
    # The injected regression is TTFT 80 -> 320 ms (+300%). What did not change (ITL) differs
    # between runs by what a busy machine does to runs that overlap each other: well within
    # the interval and the scenario's 20 ms slack, at the default tolerance.
    proc = run_cli("history", str(runs.history), "--window", "2", "--min-runs", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "quick: last 3 of 3 runs" in out
    assert "against the previous 2 run(s)" in out and "compare's test" in out, out
    flags = [line for line in out.splitlines() if line.startswith("REGRESSION")]
    assert any("baseline.ttft_ms.p95" in f and "interval" in f for f in flags), out
    assert not any(".itl_ms." in f for f in flags), out      # ITL did not change
    assert "scenario file changed" in out                    # b's file differs: said so
    # A flagged metric is a column of the table, whether or not it is a usual one.
    header = next(line for line in out.splitlines() if "scenario sha256" in line)
    for f in flags:
        phase, metric, stat = f.split(": ")[1].split(" = ")[0].split(".")
        assert " ".join(x for x in (phase, metric, stat) if x != "value") in header, (f, header)


def _flagged(out: str) -> set[str]:
    return {line.split(": ")[1].split(" = ")[0] for line in out.splitlines()
            if line.startswith("REGRESSION")}


@pytest.mark.timeout(240)
def test_history_says_what_compare_says_on_the_same_two_runs(runs: Runs,
                                                              tmp_path: Path) -> None:
    proc = run_cli("history", str(runs.history), "--window", "1", "--min-runs", "1")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    with sqlite3.connect(runs.history) as db:
        reports = [r for (r,) in db.execute("SELECT report FROM runs ORDER BY started_at, id")]
    out = tmp_path / "c.json"
    cmp = run_cli("compare", reports[-2], reports[-1], "--different-scenarios", "--json",
                  str(out))
    assert cmp.returncode == proc.returncode, cmp.stdout + cmp.stderr
    from streamquake.reports.history import WATCHED

    watched = {(m, None if s == "value" else float(s[1:])): s for m, s in WATCHED}
    worse = {f"{r['phase']}.{r['metric']}.{watched[(r['metric'], r['percentile'])]}"
             for r in json.loads(out.read_text())["rows"]
             if r["verdict"] == "worse" and (r["metric"], r["percentile"]) in watched}
    assert worse and _flagged(proc.stdout) == worse, (proc.stdout, worse)


@pytest.mark.timeout(120)
def test_too_few_earlier_runs_are_no_judgement(runs: Runs) -> None:
    # a, a2, then b (TTFT x4): two earlier runs, three needed by default. Said, and exit 0.
    proc = run_cli("history", str(runs.history))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not judged: 2 earlier run(s) ran to the end, 3 needed (--min-runs)" in proc.stdout
    assert "REGRESSION" not in proc.stdout


def _stats(ttfb_ms: float, n: int = 200) -> dict:
    """A phase's stats from ``n`` requests whose TTFB p95 is ``ttfb_ms``."""
    from streamquake.loadgen.metrics import Stats
    from streamquake.loadgen.samples import RequestSample

    samples = [RequestSample(cls="c", sent=1.0 + i, ttfb_ms=ttfb_ms * (i + 1) / (0.95 * n),
                             ttft_ms=80.0, e2e_ms=400.0, itl_ms=[10.0] * 20, output_tokens=21)
               for i in range(n)]
    return Stats.from_samples(samples).to_dict()


def _append(store: Path, name: str, ttfb_ms: float, reports: Path,
            report: Path | None = None, started: float | None = None) -> tuple[int, object]:
    from streamquake.reports.history import append_run
    from streamquake.result import PhaseResult, RunResult

    started = time.time() if started is None else started
    result = RunResult(name, f"{name}.yaml", {"recovery": {"slack": 5.0}}, "0", started,
                       started + 1, None,
                       [PhaseResult(p, 0.0, 1.0, _stats(ttfb_ms)) for p in
                        ("baseline", "fault", "recovery")], [], [], {},
                       environment={"scenario_sha256": "x", "host": "h"})
    report = report or reports / f"{name}-{time.monotonic_ns()}" / "report.json"  # unwritten
    return append_run(store, result, report), result


@pytest.mark.timeout(120)
def test_a_report_a_later_run_overwrote_is_no_baseline(runs: Runs, tmp_path: Path) -> None:
    # Nightly runs that reuse one --out: every stored path names the latest report. The
    # earlier runs' figures are then the stored ones, never the latest run's requests again.
    report = runs["a"].out / "report.json"
    started = json.loads(report.read_text())["started_at"]
    store = tmp_path / "history.sqlite"
    _append(store, "quick", 4.759, tmp_path, report, started - 86400)
    _append(store, "quick", 4.759, tmp_path, report, started)
    proc = run_cli("history", str(store), "--window", "1", "--min-runs", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"run 1's report {report} is now a later run's" in proc.stdout, proc.stdout
    assert "point estimates" in proc.stdout


@pytest.mark.timeout(60)
def test_a_move_within_the_scenarios_slack_is_no_regression(tmp_path: Path) -> None:
    # The case: TTFB p95 4.759 -> 7.373 ms (+55%), a 2.6 ms move, inside the
    # scenario's 5 ms slack; a 30 ms move is a regression. The reports are gone: point
    # estimates against the same margin, and the output says so.
    from streamquake.reports.history import read_runs, trend

    store = tmp_path / "history.sqlite"
    latest = {}
    for name, moved in (("small", 7.373), ("big", 34.759)):
        for _ in range(3):
            _append(store, name, 4.759, tmp_path)
        latest[name] = _append(store, name, moved, tmp_path)
    proc = run_cli("history", str(store))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    ttfb = {f"{p}.ttfb_ms.p95" for p in ("baseline", "fault", "recovery")}
    assert _flagged(proc.stdout) == ttfb, proc.stdout
    assert all("big run" in line for line in proc.stdout.splitlines()
               if line.startswith("REGRESSION")), proc.stdout
    assert "small: latest run 4 has no regression" in proc.stdout
    assert "point estimates" in proc.stdout and "cannot be read" in proc.stdout
    # report.html's trend rings what the default check flags, by the same judgement.
    assert len(read_runs(store, "small")) == 4
    for name, (run_id, result) in latest.items():
        marks = trend(store, run_id, result, tmp_path / "gone" / "report.json")[-1]
        assert set(marks.regressed) == (set() if name == "small" else ttfb), marks


@pytest.mark.timeout(60)
def test_options_that_would_mean_something_else_are_usage_errors(runs: Runs) -> None:
    for args in (["--window", "0"], ["--min-runs", "0"], ["--last", "0"],
                 ["--scenario", "nope"], ["--window", "2", "--min-runs", "3"]):
        proc = run_cli("history", str(runs.history), *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), (args, proc.stderr)
    proc = run_cli("history", str(runs.history), "--scenario", "nope")
    assert "it holds quick" in proc.stderr


@pytest.mark.timeout(30)
def test_history_without_a_store_says_how_to_make_one(tmp_path: Path) -> None:
    proc = run_cli("history", str(tmp_path / "none.sqlite"))
    assert proc.returncode == 3 and "run --history" in proc.stderr
