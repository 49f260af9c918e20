"""The run history: a SQLite file that nightly jobs append each run to, and that
``streamquake history`` reads back as trends, flagging regressions against a rolling baseline.

A latest run is judged as ``streamquake compare`` judges B against A (reports/compare.py), with
the requests of the ``window`` runs before it, pooled, as A: a watched metric regressed only
when the whole bootstrap interval of the change lies beyond max(tolerance, floor), the floor
for latencies being the scenario's ``recovery.slack`` where larger. It takes ``min_runs``
earlier runs that ran to the end, and says so when there are fewer. Where a run's report or
samples are gone, the stored percentiles are judged against the same margin with no interval
(the median of the earlier runs against the latest), and the output says so.

Each append is one transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``) in WAL mode with
``synchronous=FULL``: a process killed mid-append leaves the store as it was before that run,
never half a run. ``runs.n_metrics`` records how many metric rows the run has, so a reader can
check that what it reads is whole.

A ``steps:`` run stores each step but the warmup ones (and those an abort skipped) under the
step's name, in the ``phase`` column, in the order of its timeline; runs are matched step by
step, by name, as ``compare`` matches them.
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
from streamquake.reports.compare import _signed, compare, judge
from streamquake.reports.phrasing import value_text
from streamquake.reports.saved_run import LoadedRun, load_run, loaded_from, pool
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
# The defaults of `streamquake history` (and of the marks on report.html's trend).
WINDOW, TOLERANCE, MIN_RUNS = 5, 0.10, 3

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
  n_metrics INTEGER NOT NULL,
  slack_ms REAL
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
            if "slack_ms" not in {row[1] for row in conn.execute("PRAGMA table_info(runs)")}:
                conn.execute("ALTER TABLE runs ADD COLUMN slack_ms REAL")   # older stores
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
        if phase.status in ("not run", "skipped") or (
                phase.kind == "warmup" if result.steps_form else phase.name not in PHASES):
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


def _slack(result: RunResult) -> float | None:
    recovery = result.scenario_echo.get("recovery")
    return _num(recovery.get("slack")) if isinstance(recovery, dict) else None


def append_run(path: Path, result: RunResult, report: Path) -> int:
    """Add ``result`` to the store in one transaction; returns its run id."""
    rows = _rows(result)
    with open_store(path) as conn:
        try:
            conn.execute("BEGIN IMMEDIATE")
            cur = conn.execute(
                "INSERT INTO runs (scenario, scenario_sha256, started_at, finished_at, exit_code,"
                " interrupted, host, version, report, n_metrics, slack_ms)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (result.scenario_name, result.environment.get("scenario_sha256", ""),
                 result.started_at, result.finished_at, result.exit_code, result.interrupted,
                 result.environment.get("host", ""), result.tool_version, str(report),
                 len(rows), _slack(result)))
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
    slack_ms: float = 0.0
    values: dict[str, float | None] = field(default_factory=dict)   # "phase.metric.stat"
    counts: dict[str, int | None] = field(default_factory=dict)

    @property
    def steps(self) -> bool:
        """Its scenario gave ``steps:``: it stored phases with names of their own."""
        return any(p not in PHASES for p in stored_phases(self))

    @property
    def measured(self) -> bool:
        """A run whose numbers may serve as a baseline: it ran to the end (SLOs met or not)."""
        return self.exit_code in (0, 1) and self.interrupted is None


def stored_phases(run: StoredRun) -> list[str]:
    """The phases (steps) a run stored, in the order of its timeline."""
    return list(dict.fromkeys(key.rsplit(".", 2)[0] for key in run.values))


def read_runs(path: Path, scenario: str | None = None) -> list[StoredRun]:
    """Every whole run (metric rows present as recorded), oldest first."""
    if not path.exists():
        raise HistoryError(f"no history store at {path}; `streamquake run --history {path}` "
                           "creates it")
    with open_store(path) as conn:
        query = ("SELECT id, scenario, scenario_sha256, started_at, exit_code, interrupted, "
                 "report, n_metrics, slack_ms FROM runs")
        args: tuple[str, ...] = ()
        if scenario is not None:
            query += " WHERE scenario = ?"
            args = (scenario,)
        runs: list[StoredRun] = []
        for row in conn.execute(query + " ORDER BY started_at, id", args).fetchall():
            run = StoredRun(int(row[0]), str(row[1]), str(row[2]), float(row[3]), int(row[4]),
                            row[5], str(row[6]), float(row[8] or 0.0))
            metric_rows = conn.execute(
                "SELECT phase, metric, stat, value, count FROM metrics WHERE run_id = ? "
                "ORDER BY rowid",
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


def trend(path: Path, run_id: int, result: RunResult, report: Path,
          last: int = 20) -> list[TrendPoint]:
    """The last ``last`` runs of ``result``'s scenario up to it (run ``run_id``, its report
    about to be written to ``report``), for the HTML report; the run itself carries the
    default check's judgement (regressed keys and a sentence)."""
    mine = read_runs(path, result.scenario_name)
    mine = [r for r in mine if r.id == run_id or r.started_at < result.started_at]
    points = [TrendPoint(r.id, r.started_at, r.exit_code, dict(r.values)) for r in mine[-last:]]
    if points and points[-1].run_id == run_id:
        judged = check_latest(mine, WINDOW, TOLERANCE, MIN_RUNS,
                              known={run_id: loaded_from(result.to_dict(), report)})
        points[-1].regressed = [f.key for f in judged.worse]
        points[-1].judgement = judged.summary()
    return points


@dataclass
class Flag:
    """One watched metric of a scenario's latest run, against the runs before it."""

    key: str                        # phase.metric.stat
    value: float | None             # the latest run
    baseline: float | None          # the earlier runs: their requests pooled, or the median
    margin: float                   # max(tolerance x baseline, floor)
    regressed: bool
    low: float | None = None        # the interval of value - baseline (None: point estimate)
    high: float | None = None

    def sentence(self) -> str:
        metric = self.key.rsplit(".", 2)[1]
        change = "-" if self.value is None or self.baseline is None else \
            _signed(metric, self.value - self.baseline)
        ci = "" if self.low is None else \
            f", interval {_signed(metric, self.low)} .. {_signed(metric, self.high)}"
        return (f"{self.key} = {value_text(metric, self.value)} against "
                f"{value_text(metric, self.baseline)} ({change}{ci}; margin "
                f"{value_text(metric, self.margin)})")


@dataclass
class Judgement:
    """A scenario's latest run against the runs before it (:func:`check_latest`)."""

    scenario: str
    latest: StoredRun
    base: list[StoredRun]
    flags: list[Flag]
    tolerance: float
    method: str = ""
    not_judged: str | None = None   # why there is no judgement
    edited: bool = False            # the scenario's definition changed within the baseline

    @property
    def worse(self) -> list[Flag]:
        return [f for f in self.flags if f.regressed]

    def summary(self) -> str:
        if self.not_judged is not None:
            return f"{self.scenario}: latest run {self.latest.id} not judged: {self.not_judged}"
        ids = ", ".join(str(r.id) for r in self.base)
        against = f"the previous {len(self.base)} run(s) ({ids}) by {self.method}"
        note = "; note: the scenario file changed within these runs (sha256 differs)" \
            if self.edited else ""
        if self.worse:
            return (f"{self.scenario}: latest run {self.latest.id} REGRESSED on "
                    f"{len(self.worse)} metric(s) against {against}{note}")
        return (f"{self.scenario}: latest run {self.latest.id} has no regression beyond "
                f"max({self.tolerance * 100:g}%, floor) against {against}{note}")


def check_latest(runs: list[StoredRun], window: int, tolerance: float,
                 min_runs: int = MIN_RUNS, resamples: int = 1000,
                 known: dict[int, LoadedRun] | None = None) -> Judgement:
    """The latest run of one scenario (by name: a nightly job keeps its name when its file is
    tuned; a changed hash is noted) against the ``window`` runs before it that ran to the end
    (interrupted and failed runs are no baseline), by compare's interval test. ``known``: runs
    already loaded, by id (a run whose report is not written yet)."""
    latest = runs[-1]
    base = [r for r in runs[:-1] if r.measured][-window:]
    judged = Judgement(latest.scenario, latest, base, [], tolerance,
                       edited=any(r.scenario_sha256 != latest.scenario_sha256 for r in base))
    if not latest.measured:
        judged.not_judged = (f"it did not run to the end (exit {latest.exit_code}"
                             f"{', ' + latest.interrupted if latest.interrupted else ''})")
    elif len(base) < min_runs:
        judged.not_judged = (f"{len(base)} earlier run(s) ran to the end, {min_runs} needed "
                             "(--min-runs)")
    else:
        loaded, missing = _load([*base, latest], known or {})
        if missing is None:
            _by_interval(judged, loaded, resamples)
        else:
            _by_point(judged, missing)
    return judged


def _load(runs: list[StoredRun], known: dict[int, LoadedRun]
          ) -> tuple[list[LoadedRun], str | None]:
    """The runs' reports with their samples, or why not."""
    loaded = []
    for r in runs:
        try:
            run = known.get(r.id) or load_run(Path(r.report))
        except StreamquakeError:
            return [], f"run {r.id}'s report {r.report} cannot be read"
        if abs(run.started_at - r.started_at) > 0.001:     # an --out used again since
            return [], f"run {r.id}'s report {r.report} is now a later run's"
        if not run.has_samples:
            return [], f"run {r.id}'s per-request samples are not beside its report {r.report}"
        loaded.append(run)
    return loaded, None


def _by_interval(judged: Judgement, loaded: list[LoadedRun], resamples: int) -> None:
    c = compare(pool(loaded[:-1]), loaded[-1], tolerance=judged.tolerance, resamples=resamples)
    judged.method = (f"compare's test, their requests pooled ({c.method}; a change counts "
                     "only when its whole interval lies beyond the margin)")
    stat_of = {m: s for m, s in WATCHED}
    for row in c.rows:
        stat = stat_of.get(row.metric)
        if stat is not None and stat == ("value" if row.pct is None else f"p{row.pct:g}"):
            judged.flags.append(Flag(f"{row.phase}.{row.metric}.{stat}", row.b, row.a,
                                     row.margin, row.verdict == "worse", row.lo, row.hi))


def _by_point(judged: Judgement, why: str) -> None:
    judged.method = (f"point estimates, the median of their stored percentiles ({why}: no "
                     "interval)")
    for phase in stored_phases(judged.latest):
        for metric, stat in WATCHED:
            key = f"{phase}.{metric}.{stat}"
            value = judged.latest.values.get(key)
            past = [v for r in judged.base if (v := r.values.get(key)) is not None]
            if value is None or not past:
                continue
            median = statistics.median(past)
            margin, verdict, _ = judge(metric, median, value - median, None, None,
                                       judged.tolerance, judged.latest.slack_ms)
            judged.flags.append(Flag(key, value, median, margin, verdict == "worse"))
