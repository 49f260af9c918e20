"""The run history: a SQLite file that nightly jobs append each run to, and that
``streamquake history`` reads back as trends, flagging regressions against a rolling baseline.

A latest run is judged against the ``window`` runs before it that ran to the end by the
variation between runs (reports/between_runs.py: the median of their figures, their robust
spread, a minimum relative change and the floors), from the figures the store holds: the
reports and samples may be gone. It takes ``min_runs`` earlier runs, and says "not enough
history" when there are fewer. A phase whose load generator the run's guard marked saturated
(``client_saturated``) gives no timing figure: the latest run's is not judged, an earlier run's
is left out of the baseline, and the output says which.

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
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.errors import StreamquakeError
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.metric_catalog import CATALOG
from streamquake.reports.between_runs import SATURATED, Notes, RunFigure, excluded, judge
from streamquake.reports.compare import _signed
from streamquake.reports.phrasing import value_text
from streamquake.result import RunResult, TrendPoint

SCHEMA_VERSION = "1"
PHASES = ("baseline", "fault", "recovery")
# (metric, stat): what each run stores per phase, as the metric catalog says, and its count of
# requests; stat "value" for rates and counts.
STORED: tuple[tuple[str, str], ...] = (
    *((m.name, s) for m in CATALOG for s in m.stored), ("requests", "value"),
)
# What the regression check watches (the catalog's ``watched``); lower is better except where
# the catalog says higher is. The medians too: a slower service moves them, where a busy
# machine moves mostly the tails.
WATCHED: tuple[tuple[str, str], ...] = tuple((m.name, s) for m in CATALOG for s in m.watched)
# The defaults of `streamquake history` (and of the marks on report.html's trend).
WINDOW, TOLERANCE, MIN_RUNS = 10, 0.10, 5
# Exit codes of a run that ran to the end: SLOs met, broken, or not judged (its load generator
# was saturated: errors.EXIT_NOT_JUDGED).
RAN_TO_THE_END = frozenset({0, 1, 6})

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
        rows += _client_rows(phase.name, phase.stats)
    return rows


def _client_rows(phase: str, stats: JsonDict) -> list[tuple[str, str, str, float | None,
                                                            int | None]]:
    """Whether the saturation guard marked the phase (1 or 0; count: its saturated seconds):
    such a phase gives no timing figure to a judgement."""
    client = stats.get("client")
    if not isinstance(client, dict):
        return []
    seconds = _num(client.get("saturated_s"))
    return [(phase, "client_saturated", "value",
             1.0 if stats.get("client_saturated") is True else 0.0,
             None if seconds is None else int(seconds))]


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
        return self.exit_code in RAN_TO_THE_END and self.interrupted is None


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
        judged = check_latest(mine, WINDOW, TOLERANCE, MIN_RUNS)
        points[-1].regressed = [f.key for f in judged.worse]
        points[-1].judgement = judged.summary()
    return points


@dataclass
class Flag:
    """One watched metric of a scenario's latest run, against the runs before it."""

    key: str                        # phase.metric.stat
    value: float | None             # the latest run
    baseline: float | None          # the median of the earlier runs
    margin: float                   # what a change must exceed (between_runs.judge)
    regressed: bool
    spread: float | None = None     # one run's standard deviation, from the earlier runs
    runs: int = 0                   # earlier runs behind the baseline
    verdict: str = "same"

    def sentence(self) -> str:
        metric = self.key.rsplit(".", 2)[1]
        change = "-" if self.value is None or self.baseline is None else \
            _signed(metric, self.value - self.baseline)
        scatter = "" if self.spread is None else \
            f", runs scatter by {value_text(metric, self.spread)}"
        return (f"{self.key} = {value_text(metric, self.value)} against a median of "
                f"{value_text(metric, self.baseline)} over {self.runs} run(s) ({change}; margin "
                f"{value_text(metric, self.margin)}{scatter})")


@dataclass
class Judgement:
    """A scenario's latest run against the runs before it (:func:`check_latest`)."""

    scenario: str
    latest: StoredRun
    base: list[StoredRun]
    flags: list[Flag]
    tolerance: float
    min_runs: int = MIN_RUNS
    not_judged: str | None = None   # why there is no judgement at all
    edited: bool = False            # the scenario's definition changed within the baseline
    # Phases (or metrics) not judged, and earlier runs left out of a phase, with why.
    notes: list[str] = field(default_factory=list)

    @property
    def worse(self) -> list[Flag]:
        return [f for f in self.flags if f.regressed]

    def summary(self) -> str:
        if self.not_judged is not None:
            return f"{self.scenario}: latest run {self.latest.id} not judged: {self.not_judged}"
        ids = ", ".join(str(r.id) for r in self.base)
        against = (f"the previous {len(self.base)} run(s) ({ids}), by the variation between "
                   "runs")
        note = "; note: the scenario file changed within these runs (sha256 differs)" \
            if self.edited else ""
        if self.worse:
            return (f"{self.scenario}: latest run {self.latest.id} REGRESSED on "
                    f"{len(self.worse)} metric(s) against {against}{note}")
        return (f"{self.scenario}: latest run {self.latest.id} has no regression beyond "
                f"max({self.tolerance * 100:g}%, floor, the variation between runs) against "
                f"{against}{note}")


def check_latest(runs: list[StoredRun], window: int, tolerance: float,
                 min_runs: int = MIN_RUNS) -> Judgement:
    """The latest run of one scenario (by name: a nightly job keeps its name when its file is
    tuned; a changed hash is noted) against the ``window`` runs before it that ran to the end
    (interrupted and aborted runs are no baseline), by the variation between runs
    (reports/between_runs.py), from the figures in the store alone."""
    latest = runs[-1]
    base = [r for r in runs[:-1] if r.measured][-window:]
    judged = Judgement(latest.scenario, latest, base, [], tolerance, min_runs,
                       edited=any(r.scenario_sha256 != latest.scenario_sha256 for r in base))
    if not latest.measured:
        judged.not_judged = (f"it did not run to the end (exit {latest.exit_code}"
                             f"{', ' + latest.interrupted if latest.interrupted else ''})")
    elif len(base) < min_runs:
        judged.not_judged = (f"not enough history ({len(base)} of {min_runs} earlier runs that "
                             "ran to the end; --min-runs): the variation between runs is not "
                             "known yet")
    else:
        for phase in stored_phases(latest):
            _judge_phase(judged, phase)
    return judged


def _figure(run: StoredRun, phase: str, metric: str, stat: str) -> RunFigure:
    saturated = None
    if run.values.get(f"{phase}.client_saturated.value"):
        seconds = run.counts.get(f"{phase}.client_saturated.value")
        saturated = (f"{SATURATED} in {phase} of run {run.id}"
                     + (f" ({seconds} s saturated)" if seconds else ""))
    key = f"{phase}.{metric}.{stat}"
    pct = None if stat == "value" else float(stat[1:])
    return RunFigure(f"run {run.id}", run.values.get(key), run.counts.get(key),
                     excluded(metric, pct, run.counts.get(key), saturated,
                              f"{phase} of run {run.id}"))


def _judge_phase(judged: Judgement, phase: str) -> None:
    latest, said = judged.latest, Notes()
    for metric, stat in WATCHED:
        earlier = [_figure(r, phase, metric, stat) for r in judged.base
                   if f"{phase}.{metric}.{stat}" in r.values]
        got = judge(metric, earlier, [_figure(latest, phase, metric, stat)],
                    tolerance=judged.tolerance, slack_ms=latest.slack_ms,
                    min_runs=judged.min_runs, too_few_runs="not enough history",
                    sides=("earlier run", "latest run"))
        key = f"{phase}.{metric}.{stat}"
        said.add(phase, metric, None if stat == "value" else float(stat[1:]), got)
        if got.verdict not in ("no data", "not judged"):
            judged.flags.append(Flag(key, got.b, got.a, got.margin, got.verdict == "worse",
                                     got.spread, got.n_a, got.verdict))
    judged.notes += said.lines()
