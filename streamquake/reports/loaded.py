"""A finished run read back from disk (report.json and, beside it, the per-request samples), for
``streamquake compare``: typed, with nothing taken on trust from the file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.errors import ScenarioError
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.loadgen.samples import RequestSample
from streamquake.reports.csv_report import read_samples
from streamquake.run.scoring import assign_phases
from streamquake.run.timeline import PhaseWindow


@dataclass
class LoadedPhase:
    name: str
    start: float
    end: float
    status: str
    stats: JsonDict
    samples: list[RequestSample] = field(default_factory=list)   # scored in this phase


@dataclass
class LoadedRun:
    path: Path                      # the report.json
    scenario_name: str
    scenario_sha256: str
    started_at: float
    exit_code: int
    phases: dict[str, LoadedPhase]
    has_samples: bool

    @property
    def label(self) -> str:
        return f"{self.scenario_name} @ {self.path.parent}"


def _float(value: JsonValue, default: float = 0.0) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default


def load_run(path: Path) -> LoadedRun:
    """``path``: a run's output directory or its report.json. Samples are read from
    ``<dir>/run/samples`` when they are there (compare needs them for confidence intervals)."""
    report = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{report}: cannot read the report ({exc.strerror or exc}); give "
                            "a run's --out directory or its report.json") from exc
    except ValueError as exc:
        raise ScenarioError(f"{report}: not a streamquake report ({exc})") from exc
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith(
            "streamquake.report/"):
        raise ScenarioError(f"{report}: not a streamquake report (no 'schema' field)")
    phases: dict[str, LoadedPhase] = {}
    for p in data.get("phases") or []:
        if isinstance(p, dict) and isinstance(p.get("name"), str):
            stats = p.get("stats")
            phases[str(p["name"])] = LoadedPhase(
                name=str(p["name"]), start=_float(p.get("start")), end=_float(p.get("end")),
                status=str(p.get("status") or "complete"),
                stats=stats if isinstance(stats, dict) else {})
    samples_dir = report.parent / "run" / "samples"
    samples = read_samples(samples_dir) if samples_dir.is_dir() else []
    windows = [PhaseWindow(p.name, p.start, p.end) for p in phases.values()]
    by_phase, _ = assign_phases(samples, windows)
    for name, group in by_phase.items():
        phases[name].samples = group
    env = data.get("environment")
    return LoadedRun(
        path=report,
        scenario_name=str(data.get("scenario_name", "?")),
        scenario_sha256=str(env.get("scenario_sha256", "")) if isinstance(env, dict) else "",
        started_at=_float(data.get("started_at")),
        exit_code=int(_float(data.get("exit_code"))),
        phases=phases,
        has_samples=bool(samples),
    )
