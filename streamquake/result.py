"""The result of one run: what reports render. Reports compute nothing the runner did not."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from streamquake.jsontypes import JsonDict


@dataclass
class Check:
    """One SLO evaluated in one phase (and class), or one recovery-vs-baseline comparison."""

    name: str
    kind: str                      # "slo" | "recovery"
    phase: str
    metric: str
    op: str                        # "<=" | ">="
    threshold: float
    observed: float | None
    passed: bool
    gating: bool                   # counts toward the exit code
    cls: str | None = None
    percentile: float | None = None
    detail: str = ""


@dataclass
class FaultRecord:
    name: str
    type: str
    phase: str
    configured: JsonDict
    applied_at: float | None = None
    applied: JsonDict | None = None
    reverted_at: float | None = None
    reverted: JsonDict | None = None
    owner: str = ""                # host:pid of the process that applied it
    error: str | None = None


@dataclass
class PhaseResult:
    name: str
    start: float
    end: float
    stats: JsonDict
    classes: dict[str, JsonDict] = field(default_factory=dict)


@dataclass
class RunResult:
    scenario_name: str
    scenario_file: str
    scenario_echo: JsonDict
    tool_version: str
    started_at: float
    finished_at: float
    interrupted: str | None                    # None, "SIGINT" or "SIGTERM"
    phases: list[PhaseResult]
    checks: list[Check]
    faults: list[FaultRecord]
    target: JsonDict
    telemetry: JsonDict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    exit_code: int = 0

    @property
    def broken(self) -> list[Check]:
        return [c for c in self.checks if c.gating and not c.passed]

    def to_dict(self) -> JsonDict:
        return asdict(self)
