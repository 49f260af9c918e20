"""The run history: a SQLite file that nightly jobs append each run to, and that
``streamquake history`` reads back as trends, flagging regressions against a rolling baseline.

Each append is one transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``) in WAL mode with
``synchronous=FULL``: a process killed mid-append leaves the store as it was before that run,
never half a run. ``runs.n_metrics`` records how many metric rows the run has, so a reader can
check that what it reads is whole.
"""

from __future__ import annotations

import sqlite3
import statistics
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.errors import StreamquakeError
from streamquake.jsontypes import JsonValue
from streamquake.result import RunResult, TrendPoint

SCHEMA_VERSION = "1"
PHASES = ("baseline", "fault", "recovery")
# (metric, stat): what each run stores per phase; stat "value" for rates and counts.
STORED: tuple[tuple[str, str], ...] = (
    *((m, s) for m in ("ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms") for s in ("p50", "p95", "p99")),
    ("output_tokens_per_s", "p50"), ("error_rate", "value"), ("stall_rate", "value"),
    ("chunk_loss", "value"), ("requests", "value"),
)
# What the regression check watches; lower is better except tokens/s.
WATCHED: tuple[tuple[str, str], ...] = (
    ("ttfb_ms", "p95"), ("ttft_ms", "p95"), ("itl_ms", "p95"), ("e2e_ms", "p95"),
    ("output_tokens_per_s", "p50"), ("error_rate", "value"),
)
FLOORS = {"ms": 1.0, "rate": 0.005, "output_tokens_per_s": 1.0}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  scenario TEXT NOT NULL,
  scenario_sha256 TEXT NOT NULL,
  started_at REAL NOT NULL,
  finished_at REAL NOT NULL,
  exit_code INTEGER NOT NULL,
  interrupted TEXT,
  host TEXT NOT NULL,
  version TEXT NOT NULL,
  report TEXT NOT NULL,
  n_metrics INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
  run_id INTEGER NOT NULL REFERENCES runs(id),
  phase TEXT NOT NULL,
  metric TEXT NOT NULL,
  stat TEXT NOT NULL,
  value REAL,
  count INTEGER,
  PRIMARY KEY (run_id, phase, metric, stat)
);
CREATE INDEX IF NOT EXISTS runs_by_scenario ON runs (scenario, started_at);
"""


class HistoryError(StreamquakeError):
    """The history store cannot be opened, read or written."""


@contextmanager
def open_store(path: Path) -> Iterator[sqlite3.Connection]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    except (OSError, sqlite3.Error) as exc:
        raise HistoryError(f"cannot open the history store {path}: {exc}") from exc
    with closing(conn):
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{path} is not a streamquake history store ({exc})") from exc
        yield conn


def _num(value: JsonValue) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _rows(result: RunResult) -> list[tuple[str, str, str, float | None, int | None]]:
    rows = []
    for phase in result.phases:
        if phase.name not in PHASES or phase.status == "not run":
            continue
        requests = _num(phase.stats.get("requests"))
        for metric, stat in STORED:
            raw = phase.stats.get(metric)
            if stat == "value":
                value, count = _num(raw), requests
            else:
                summary = raw if isinstance(raw, dict) else {}
                value, n = _num(summary.get(stat)), _num(summary.get("count"))
                count = n
            rows.append((phase.name, metric, stat, value,
                         None if count is None else int(count)))
    return rows


def append_run(path: Path, result: RunResult, report: Path) -> int:
    """Add ``result`` to the store in one transaction; returns its run id."""
    rows = _rows(result)
    with open_store(path) as conn:
        try:
            conn.execute("BEGIN IMMEDIATE")
            cur = conn.execute(
                "INSERT INTO runs (scenario, scenario_sha256, started_at, finished_at, exit_code,"
                " interrupted, host, version, report, n_metrics) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (result.scenario_name, result.environment.get("scenario_sha256", ""),
                 result.started_at, result.finished_at, result.exit_code, result.interrupted,
                 result.environment.get("host", ""), result.tool_version, str(report),
                 len(rows)))
            run_id = cur.lastrowid
            assert run_id is not None
            conn.executemany("INSERT INTO metrics VALUES (?,?,?,?,?,?)",
                             [(run_id, *row) for row in rows])
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise HistoryError(f"cannot append to the history store {path}: {exc}") from exc
    return int(run_id)


@dataclass
class StoredRun:
    id: int
    scenario: str
    scenario_sha256: str
    started_at: float
    exit_code: int
    interrupted: str | None
    report: str
    values: dict[str, float | None] = field(default_factory=dict)   # "phase.metric.stat"
    counts: dict[str, int | None] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        """A run whose numbers may serve as a baseline: it ran to the end (SLOs met or not)."""
        return self.exit_code in (0, 1) and self.interrupted is None


def read_runs(path: Path, scenario: str | None = None) -> list[StoredRun]:
    """Every whole run (metric rows present as recorded), oldest first."""
    if not path.exists():
        raise HistoryError(f"no history store at {path}; `streamquake run --history {path}` "
                           "creates it")
    with open_store(path) as conn:
        query = ("SELECT id, scenario, scenario_sha256, started_at, exit_code, interrupted, "
                 "report, n_metrics FROM runs")
        args: tuple[str, ...] = ()
        if scenario is not None:
            query += " WHERE scenario = ?"
            args = (scenario,)
        runs: list[StoredRun] = []
        for row in conn.execute(query + " ORDER BY started_at, id", args).fetchall():
            run = StoredRun(int(row[0]), str(row[1]), str(row[2]), float(row[3]), int(row[4]),
                            row[5], str(row[6]))
            metric_rows = conn.execute(
                "SELECT phase, metric, stat, value, count FROM metrics WHERE run_id = ?",
                (run.id,)).fetchall()
            if len(metric_rows) != int(row[7]):
                raise HistoryError(f"run {run.id} in {path} has {len(metric_rows)} metric rows, "
                                   f"{row[7]} recorded: the store is damaged")
            for phase, metric, stat, value, count in metric_rows:
                key = f"{phase}.{metric}.{stat}"
                run.values[key] = value
                run.counts[key] = count
            runs.append(run)
    return runs


def trend(path: Path, result: RunResult, last: int = 20) -> list[TrendPoint]:
    """This scenario's last ``last`` runs, for the HTML report."""
    runs = read_runs(path, result.scenario_name)
    return [TrendPoint(r.id, r.started_at, r.exit_code, dict(r.values)) for r in runs[-last:]]


@dataclass
class Flag:
    """One watched metric of a scenario's latest run, against the rolling baseline."""

    scenario: str
    run_id: int
    key: str                        # phase.metric.stat
    value: float
    baseline: float                 # median of the baseline runs
    baseline_runs: int
    regressed: bool
    edited: bool = False            # the scenario's definition changed within the baseline

    def sentence(self, tolerance: float) -> str:
        change = (self.value - self.baseline) / self.baseline * 100 if self.baseline else 0.0
        note = "; note: the scenario file changed since some baseline runs (sha256 differs)" \
            if self.edited else ""
        return (f"{self.scenario} run {self.run_id}: {self.key} = {self.value:.4g}, rolling "
                f"median of the previous {self.baseline_runs} run(s) {self.baseline:.4g} "
                f"({change:+.0f}%, tolerance {tolerance * 100:g}%){note}")


def _floor(metric: str) -> float:
    if metric.endswith("_ms"):
        return FLOORS["ms"]
    return FLOORS["output_tokens_per_s"] if metric == "output_tokens_per_s" else FLOORS["rate"]


def check_latest(runs: list[StoredRun], window: int, tolerance: float) -> list[Flag]:
    """The latest run of one scenario (by name: a nightly job keeps its name when its file is
    tuned; a changed hash is noted) against the median of the ``window`` runs before it that
    ran to the end (interrupted and failed runs are no baseline). A metric regresses when it
    is worse than that median by more than max(tolerance x median, a small absolute floor)."""
    if not runs:
        return []
    latest = runs[-1]
    base_runs = [r for r in runs[:-1] if r.measured][-window:]
    edited = any(r.scenario_sha256 != latest.scenario_sha256 for r in base_runs)
    flags: list[Flag] = []
    if not base_runs or not latest.measured:
        return flags
    for phase in PHASES:
        for metric, stat in WATCHED:
            key = f"{phase}.{metric}.{stat}"
            value = latest.values.get(key)
            past = [v for r in base_runs if (v := r.values.get(key)) is not None]
            if value is None or not past:
                continue
            median = statistics.median(past)
            margin = max(tolerance * abs(median), _floor(metric))
            bad = (median - value) if metric == "output_tokens_per_s" else (value - median)
            flags.append(Flag(latest.scenario, latest.id, key, value, median, len(past),
                              bad > margin, edited))
    return flags
