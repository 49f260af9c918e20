"""Short real runs of one scenario, again and again, shared by test_compare.py and
test_history.py (started once per test session, one after another so that they do not load
each other, each appended to one history store through the real CLI):

* ``a1``..``a4``: the same scenario (``repeat``), four times: identical runs.
* ``r1``, ``r2``: the same scenario name with the embedded target's first-token delay doubled
  (80 -> 160 ms median: a real regression, injected in the target).
* ``f``: ``r``'s scenario (the slow target) with the load process's hub held 150 ms every
  second (``STREAMQUAKE_TEST_FREEZE``): its guard marks every phase saturated, so its timings,
  twice ``a``'s, are the load generator's as much as the target's and may not be judged.

The store holds them in that order; :func:`store_of` copies it with only the runs named.
"""

from __future__ import annotations

import functools
import os
import shutil
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, cli_cmd

SCENARIO = """
name: repeat
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: {{dist: lognormal, median: {ttft}ms, sigma: 0.1}}
    itl: {{dist: normal, mean: 10ms, stddev: 1ms}}
    output_tokens: {{min: 10, max: 15}}
    seed: 5
  timeout: 10s
load:
  users: 4
  think_time: {{min: 30ms, max: 60ms}}
  seed: 5
phases: {{warmup: 3s, baseline: 3s, fault: 0s, recovery: 3s}}
# No recovery check; its slack is the least change in milliseconds that compare and history
# count (floor_for): without it 1 ms, and a CI run's r1 read recovery ITL p95 13.4 ms against
# 11.7-12.4 in a1-a3 (the target's 10 +- 1 ms ITL, unchanged; a busy machine's tail) and was
# flagged. With 3 ms, a later CI run's r1 read baseline ITL p95 16.4 ms against 12.4-13.0
# (recovery 15.9 against 12.0-13.6), beside the tier's other worker, and was flagged again;
# an earlier one's a4 read 16.1 against 11.9-12.3. 5 ms, a sixteenth of the 80 ms TTFT
# regression these runs inject, as an SRE sets it for a shared runner of two cores.
recovery: {{metrics: [], slack: 5ms}}
slos:
  - {{metric: error_rate, max: 5%}}
"""
ORDER = ("a1", "a2", "a3", "a4", "r1", "r2", "f")
FREEZE = "150/1"


@dataclass
class Repeat:
    root: Path
    history: Path
    outs: dict[str, Path]           # name -> --out directory
    returncodes: dict[str, int]
    stdout: dict[str, str]

    def __getitem__(self, name: str) -> Path:
        return self.outs[name]

    def store_of(self, *names: str) -> Path:
        """A copy of the store with only the runs ``names`` (in their order in the store)."""
        keep = {str(self.outs[n] / "report.json") for n in names}
        path = Path(tempfile.mkdtemp(prefix="sq-store-", dir=self.root)) / "history.sqlite"
        with sqlite3.connect(self.history) as src, sqlite3.connect(path) as dst:
            src.backup(dst)
            gone = [i for i, report in dst.execute("SELECT id, report FROM runs")
                    if report not in keep]
            dst.executemany("DELETE FROM metrics WHERE run_id = ?", [(i,) for i in gone])
            dst.executemany("DELETE FROM runs WHERE id = ?", [(i,) for i in gone])
            # Numbered 1, 2, ... in their order, as a store of these runs alone would be.
            kept = [i for (i,) in dst.execute("SELECT id FROM runs ORDER BY id")]
            for new, old in enumerate(kept, start=1):
                dst.execute("UPDATE metrics SET run_id = ? WHERE run_id = ?", (new, old))
                dst.execute("UPDATE runs SET id = ? WHERE id = ?", (new, old))
        return path


@functools.cache
def repeat_runs() -> Repeat:
    from streamquake.loadgen.holds import FREEZE_ENV

    root = Path(tempfile.mkdtemp(prefix="sq-repeat-runs-"))
    history = root / "history.sqlite"
    files = {"a": root / "repeat.yaml", "r": root / "repeat-slow.yaml"}
    files["a"].write_text(SCENARIO.format(ttft=80))
    files["r"].write_text(SCENARIO.format(ttft=160))
    outs, codes, stdout = {}, {}, {}
    for name in ORDER:
        out = outs[name] = root / name
        env = {**os.environ, "STREAMQUAKE_STATE_DIR": str(root / f"state-{name}")}
        if name == "f":
            env[FREEZE_ENV] = FREEZE
        proc = subprocess.run(cli_cmd("run", str(files["a" if name[0] == "a" else "r"]),
                                      "--out", str(out), "--history", str(history)),
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=180,
                              check=False)
        codes[name], stdout[name] = proc.returncode, proc.stdout + proc.stderr
        assert (out / "report.json").exists(), stdout[name][-3000:]
    import atexit

    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return Repeat(root, history, outs, codes, stdout)
