"""The history store: a SIGKILL in the middle of appends leaves it intact with every committed
run whole; `streamquake history` over real runs flags the run whose target got slower against
the rolling median of the runs before it."""

from __future__ import annotations

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
from streamquake.history import append_run
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
    from streamquake.history import read_runs

    assert [r.id for r in read_runs(store)] == committed
    proc = run_cli("history", str(store), "--scenario", "kill-0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kill-0" in proc.stdout and "within 10%" in proc.stdout


@pytest.mark.timeout(240)
def test_history_flags_the_run_that_got_slower(runs: Runs) -> None:
    # The injected regression is TTFT 80 -> 320 ms (+300%). What did not change (ITL) still
    # differs between runs by what a busy machine does to runs that overlap each other (+11%
    # seen with a busy loop on each of 2 cores): a tolerance of half tells the two apart.
    proc = run_cli("history", str(runs.history), "--window", "2", "--tolerance", "50%")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "quick: last 3 of 3 runs" in out
    flags = [line for line in out.splitlines() if line.startswith("REGRESSION")]
    assert any("baseline.ttft_ms.p95" in f and "previous 2 run(s)" in f for f in flags), out
    assert not any(".itl_ms." in f for f in flags), out      # ITL did not change
    assert "scenario file changed" in out                    # b's file differs: said so


@pytest.mark.timeout(30)
def test_history_without_a_store_says_how_to_make_one(tmp_path: Path) -> None:
    proc = run_cli("history", str(tmp_path / "none.sqlite"))
    assert proc.returncode == 3 and "run --history" in proc.stderr
