"""A finished run read back from disk (report.json and, beside it, the per-request samples), for
``streamquake compare`` and ``history``: typed, with nothing taken on trust from the file. Each
request's measurements go to the phases the run counted them in, by the run's one rule
(``loadgen/scorecard.py``'s ``attribute``), so compare's figures are the report's."""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.errors import ScenarioError
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.loadgen.attribution import attribute
from streamquake.loadgen.samples import RequestSample
from streamquake.reports.csv_report import read_samples
from streamquake.run.timeline import PhaseWindow


@dataclass
class Share:
    """What one request counts in one phase, as ``attribute`` tells it (a ``Cell``)."""

    sample: RequestSample
    first_byte: bool = False
    first_token: bool = False
    gaps: list[float] = field(default_factory=list)
    ended: bool = False            # its end (outcome, E2E, tokens/s, stalls, chunks) counts here
    late_errors: dict[str, int] = field(default_factory=dict)
    # Measurements its timeout cut off: metric -> the lower bounds (ms) they are known by.
    censored: dict[str, list[float]] = field(default_factory=dict)

    def add_retried(self, s: RequestSample) -> None:
        pass

    def add_sent(self, s: RequestSample) -> None:
        pass

    def add_queue_delay(self, s: RequestSample) -> None:
        pass

    def add_unattributed(self, metric: str, n: int = 1) -> None:
        pass

    def add_ended_after(self, metric: str, n: int = 1) -> None:
        pass

    def add_censored(self, metric: str, at_least_ms: float, at: float | None = None) -> None:
        self.censored.setdefault(metric, []).append(at_least_ms)

    def add_first_byte(self, s: RequestSample) -> None:
        self.first_byte = True

    def add_first_token(self, s: RequestSample) -> None:
        self.first_token = True

    def add_gaps(self, gaps_ms: list[float], at: float | None = None) -> None:
        self.gaps += gaps_ms

    def add_outcome(self, s: RequestSample) -> None:
        self.ended = not s.cancelled    # abandoned by the client: no outcome (loadgen/metrics)


def shares(samples: list[RequestSample], windows: list[PhaseWindow]) -> dict[str, list[Share]]:
    """Per phase, the share of each request that counts there (retried attempts are no
    request: the run counts them apart)."""
    out: dict[str, list[Share]] = {w.name: [] for w in windows}
    for s in samples:
        if not s.retried:
            for name, share in _split(s, windows).items():
                out[name].append(share)
    return out


def _split(s: RequestSample, windows: list[PhaseWindow]) -> dict[str, Share]:
    mine: dict[str, Share] = {}
    attribute(s, windows, lambda name: mine.setdefault(name, Share(s)))
    return mine


@dataclass
class LoadedPhase:
    name: str
    start: float
    end: float
    status: str
    stats: JsonDict
    samples: list[Share] = field(default_factory=list)   # what of each request counts here
    kind: str = ""                  # the step's kind (a phase's is its name)


@dataclass
class LoadedRun:
    path: Path                      # the report.json
    scenario_name: str
    scenario_sha256: str
    started_at: float
    exit_code: int
    phases: dict[str, LoadedPhase]
    has_samples: bool
    slack_ms: float = 0.0           # its scenario's recovery.slack: the smallest latency change
    steps_form: bool = False        # its scenario gave ``steps:`` (``phases``: its steps, in order)

    @property
    def label(self) -> str:
        return f"{self.scenario_name} @ {self.path.parent}"


def _float(value: JsonValue, default: float = 0.0) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default


# A report.json is a few MiB at most (samples are beside it): past this it is no report.
REPORT_MAX_BYTES = 512 << 20


def load_run(path: Path) -> LoadedRun:
    """``path``: a run's output directory or its report.json. Samples are read from
    ``<dir>/run/samples`` when they are there (compare needs them for confidence intervals)."""
    report = path / "report.json" if path.is_dir() else path
    try:
        st = report.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > REPORT_MAX_BYTES:
            what = ("a file of more than 512 MiB" if stat.S_ISREG(st.st_mode)
                    else "not a run directory or a file")
            raise ScenarioError(f"{report}: {what}, so no run's report; give a run's --out "
                                "directory or its report.json")
        data = json.loads(report.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{report}: cannot read the report ({exc.strerror or exc}); give "
                            "a run's --out directory or its report.json") from exc
    except ValueError as exc:
        raise ScenarioError(f"{report}: not a streamquake report ({exc})") from exc
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith(
            "streamquake.report/"):
        raise ScenarioError(f"{report}: not a streamquake report (no 'schema' field)")
    return loaded_from(data, report)


def loaded_from(data: JsonDict, report: Path) -> LoadedRun:
    """A run from its result as a dict (report.json's, or ``RunResult.to_dict()`` before
    report.json is written), its samples beside ``report``."""
    phases: dict[str, LoadedPhase] = {}
    listed = data.get("phases")
    for p in listed if isinstance(listed, list) else []:
        if isinstance(p, dict) and isinstance(p.get("name"), str):
            stats = p.get("stats")
            phases[str(p["name"])] = LoadedPhase(
                name=str(p["name"]), start=_float(p.get("start")), end=_float(p.get("end")),
                status=str(p.get("status") or "complete"),
                stats=stats if isinstance(stats, dict) else {},
                kind=str(p.get("kind") or p["name"]))
    samples_dir = report.parent / "run" / "samples"
    try:
        samples = read_samples(samples_dir) if samples_dir.is_dir() else []
    except OSError as exc:
        raise ScenarioError(f"{samples_dir}: cannot read the run's samples "
                            f"({exc.strerror or exc})") from exc
    windows = [PhaseWindow(p.name, p.start, p.end) for p in phases.values()]
    for name, group in shares(samples, windows).items():
        phases[name].samples = group
    env = data.get("environment")
    echo = data.get("scenario_echo")
    recovery = echo.get("recovery") if isinstance(echo, dict) else None
    return LoadedRun(
        path=report,
        scenario_name=str(data.get("scenario_name", "?")),
        scenario_sha256=str(env.get("scenario_sha256", "")) if isinstance(env, dict) else "",
        started_at=_float(data.get("started_at")),
        exit_code=int(_float(data.get("exit_code"))),
        phases=phases,
        has_samples=bool(samples),
        slack_ms=_float(recovery.get("slack")) if isinstance(recovery, dict) else 0.0,
        steps_form=data.get("steps_form") is True,
    )


def pool(runs: list[LoadedRun]) -> LoadedRun:
    """Several runs as one: each phase's requests together (history's baseline for compare's
    test); the newest run's identity, no point figures of its own."""
    last = runs[-1]
    phases = {name: LoadedPhase(name, 0.0, 0.0, "complete", {},
                                [s for r in runs for s in r.phases[name].samples], p.kind)
              for name, p in last.phases.items()
              if all(name in r.phases and r.phases[name].status != "not run" for r in runs)}
    return LoadedRun(last.path, last.scenario_name, last.scenario_sha256, last.started_at,
                     last.exit_code, phases, all(r.has_samples for r in runs), last.slack_ms,
                     last.steps_form)
