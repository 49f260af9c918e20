"""The scenario schema and its loader: YAML in, one validated immutable plan out.

Every problem in a file is reported at once as ``file:line:col: field.path: message (hint)``.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError

from streamquake.errors import ScenarioError
from streamquake.injectors.gpu_clocks import GpuClocksFault
from streamquake.injectors.netem import NetemFault
from streamquake.injectors.spec import PhaseName
from streamquake.injectors.sse_proxy import SSEProxyFault
from streamquake.injectors.tbf import TbfFault
from streamquake.netns import NetworkConfig
from streamquake.target.config import Protocol, TargetConfig
from streamquake.units import parse_duration_ms, parse_duration_s, parse_fraction

SCORED_PHASES: tuple[PhaseName, ...] = ("baseline", "fault", "recovery")
PHASE_ORDER: tuple[PhaseName, ...] = ("warmup", "baseline", "fault", "recovery")

HistogramMetric = Literal["ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens_per_s"]
RateMetric = Literal["error_rate", "stall_rate", "chunk_loss"]
Metric = Literal[
    "ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens_per_s",
    "error_rate", "stall_rate", "chunk_loss",
]
HISTOGRAM_METRICS: tuple[str, ...] = typing.get_args(HistogramMetric)
RATE_METRICS: tuple[str, ...] = typing.get_args(RateMetric)
# Metrics where a bigger number is the better one.
HIGHER_IS_BETTER: frozenset[str] = frozenset({"output_tokens_per_s"})

ENV_REF = re.compile(r"\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _dur_s(v: Any) -> float:
    return parse_duration_s(v)


class TargetSpec(_Model):
    protocol: Protocol
    model: str = "sim-1"
    url: str | None = None
    embedded: TargetConfig | None = None
    path: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    verify_tls: bool = True
    timeout_s: float = Field(default=60.0, alias="timeout", gt=0)
    connect_timeout_s: float = Field(default=5.0, alias="connect_timeout", gt=0)

    _t = field_validator("timeout_s", "connect_timeout_s", mode="before")(_dur_s)

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/]+", v):
            raise ValueError(
                "must start with http:// or https:// and name a host, e.g. http://127.0.0.1:8000"
            )
        return v.rstrip("/") if v else v

    @field_validator("headers")
    @classmethod
    def _env_refs(cls, v: dict[str, str]) -> dict[str, str]:
        for value in v.values():
            for name in ENV_REF.findall(value):
                if not _ENV_NAME.match(name):
                    raise ValueError(f"'${{{name}}}' is not an environment variable name")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> TargetSpec:
        if (self.url is None) == (self.embedded is None):
            raise ValueError(
                "give exactly one of 'url' (a running endpoint) or 'embedded' (the simulated "
                "server, e.g. 'embedded: {}')"
            )
        return self


class ThinkTime(_Model):
    min_s: float = Field(default=0.0, alias="min", ge=0)
    max_s: float = Field(default=0.0, alias="max", ge=0)

    _t = field_validator("min_s", "max_s", mode="before")(_dur_s)

    @model_validator(mode="after")
    def _order(self) -> ThinkTime:
        if self.max_s < self.min_s:
            raise ValueError("'max' must not be smaller than 'min'")
        return self


class Arrival(_Model):
    rate_per_s: float = Field(alias="rate", gt=0)
    process: Literal["constant", "poisson"] = "poisson"
    max_inflight: int = Field(default=1000, ge=1)

    @field_validator("rate_per_s", mode="before")
    @classmethod
    def _rate(cls, v: Any) -> Any:
        # "10/s", "600/m" or a bare number of requests per second.
        if isinstance(v, str):
            m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|m|min)\s*$", v)
            if not m:
                raise ValueError(f"expected a rate like '10/s' or '600/m', got {v!r}")
            return float(m[1]) / (1.0 if m[2] == "s" else 60.0)
        return v


class SLOSpec(_Model):
    metric: Metric
    percentile: float | None = Field(default=None, gt=0, le=100)
    max: float | None = None
    min: float | None = None
    phases: list[PhaseName] = Field(default_factory=lambda: list(SCORED_PHASES))
    name: str | None = None

    @field_validator("max", "min", mode="before")
    @classmethod
    def _threshold(cls, v: Any) -> Any:
        # Rates may be written as percentages ("1%"); ms metrics as durations ("350ms").
        if isinstance(v, str) and v.strip().endswith("%"):
            return parse_fraction(v)
        if isinstance(v, str):
            return parse_duration_ms(v)
        return v

    @model_validator(mode="after")
    def _shape(self) -> SLOSpec:
        if (self.max is None) == (self.min is None):
            raise ValueError("give exactly one threshold: 'max' (must stay below) or 'min'")
        if self.metric in HISTOGRAM_METRICS and self.percentile is None:
            raise ValueError(f"'{self.metric}' is a distribution: add 'percentile', e.g. 95")
        if self.metric in RATE_METRICS and self.percentile is not None:
            raise ValueError(f"'{self.metric}' is a rate over the phase: remove 'percentile'")
        if "warmup" in self.phases:
            raise ValueError("warm-up is never scored: use baseline, fault and/or recovery")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        what = f"{self.metric} p{self.percentile:g}" if self.percentile else self.metric
        op = f"<= {self.max:g}" if self.max is not None else f">= {self.min:g}"
        return f"{what} {op}"


class RequestClass(_Model):
    name: str = "default"
    weight: float = Field(default=1.0, gt=0)
    prompt: str | None = None
    prompts: list[str] | None = None
    max_tokens: int = Field(default=64, ge=1)
    body: dict[str, Any] | None = None
    slos: list[SLOSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestClass:
        if self.prompt is not None and self.prompts is not None:
            raise ValueError("give 'prompt' or 'prompts', not both")
        return self

    @property
    def prompt_list(self) -> list[str]:
        if self.prompts:
            return list(self.prompts)
        return [self.prompt or "Say something."]


class LoadSpec(_Model):
    users: int = Field(default=1, ge=1)
    spawn_rate: float = Field(default=0.0, ge=0, description="users started per second; 0 = all")
    think_time: ThinkTime | None = None
    arrival: Arrival | None = None
    classes: list[RequestClass] = Field(default_factory=lambda: [RequestClass()])
    stall_threshold_ms: float = Field(default=250.0, alias="stall_threshold", gt=0)
    workers: int = Field(default=0, ge=0, description="Locust worker processes; 0 = one process")
    seed: int = 0

    _st = field_validator("stall_threshold_ms", mode="before")(lambda v: parse_duration_ms(v))

    @model_validator(mode="after")
    def _loop(self) -> LoadSpec:
        if self.think_time is not None and self.arrival is not None:
            raise ValueError(
                "give 'think_time' (closed loop) or 'arrival' (open loop), not both"
            )
        names = [c.name for c in self.classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"request class names must be unique; repeated: {', '.join(dupes)}")
        return self


class PhasesSpec(_Model):
    warmup_s: float = Field(default=0.0, alias="warmup", ge=0)
    baseline_s: float = Field(alias="baseline", gt=0)
    fault_s: float = Field(alias="fault", ge=0)
    recovery_s: float = Field(alias="recovery", ge=0)

    _d = field_validator("warmup_s", "baseline_s", "fault_s", "recovery_s", mode="before")(_dur_s)

    def duration_s(self, phase: str) -> float:
        return float(getattr(self, f"{phase}_s"))

    @property
    def total_s(self) -> float:
        return sum(self.duration_s(p) for p in PHASE_ORDER)


class RecoverySpec(_Model):
    """Recovery must come back to within ``tolerance`` of baseline (plus an absolute slack)."""

    tolerance: float = 0.10
    percentile: float = Field(default=95.0, gt=0, le=100)
    metrics: list[HistogramMetric] = Field(
        default_factory=lambda: typing.cast(list[HistogramMetric], ["ttft_ms", "itl_ms"])
    )
    slack_ms: float = Field(default=5.0, alias="slack", ge=0)

    _t = field_validator("tolerance", mode="before")(lambda v: parse_fraction(v))
    _s = field_validator("slack_ms", mode="before")(lambda v: parse_duration_ms(v))


FaultModel = Annotated[
    SSEProxyFault | NetemFault | TbfFault | GpuClocksFault, Field(discriminator="type")
]


class Scenario(_Model):
    name: str
    description: str = ""
    target: TargetSpec
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    load: LoadSpec = Field(default_factory=LoadSpec)
    phases: PhasesSpec
    faults: list[FaultModel] = Field(default_factory=list)
    slos: list[SLOSpec] = Field(default_factory=list)
    recovery: RecoverySpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        labels = [f.label for f in self.faults]
        dupes = sorted({n for n in labels if labels.count(n) > 1})
        if dupes:
            raise ValueError(f"give each fault a unique 'name'; repeated: {', '.join(dupes)}")
        for f in self.faults:
            if self.phases.duration_s(f.phase) <= 0:
                raise ValueError(f"fault '{f.label}' lives in phase '{f.phase}', which lasts 0 s")
        return self


# --------------------------------------------------------------------------- loading


def load_scenario(path: str | Path) -> Scenario:
    """Read, parse and validate a scenario file; raise ScenarioError listing every problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read the scenario file: {exc.strerror or exc}") from exc
    return parse_scenario(text, str(p))


def parse_scenario(text: str, filename: str = "<scenario>") -> Scenario:
    yaml = YAML(typ="rt")
    try:
        doc = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        raise ScenarioError(f"{where}: not valid YAML: {exc.problem}") from exc
    if not isinstance(doc, CommentedMap):
        raise ScenarioError(f"{filename}:1:1: a scenario is a mapping with 'name', 'target', "
                            "'phases' (and usually 'load', 'faults', 'slos')")
    try:
        return Scenario.model_validate(_plain(doc))
    except ValidationError as exc:
        raise ScenarioError(_format_errors(exc, doc, filename)) from exc


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, bool):
        return bool(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


def _locate(doc: Any, loc: tuple[Any, ...]) -> tuple[int, int, list[str]]:
    """Walk the YAML along a pydantic error location: (line, col, yaml path found)."""
    node, line, col, path = doc, 1, 1, []
    for part in loc:
        if isinstance(node, CommentedMap) and isinstance(part, str) and part in node:
            ln, cl = node.lc.key(part)
            line, col, node = ln + 1, cl + 1, node[part]
            path.append(part)
        elif isinstance(node, CommentedSeq) and isinstance(part, int) and part < len(node):
            ln, cl = node.lc.item(part)
            line, col, node = ln + 1, cl + 1, node[part]
            path.append(str(part))
        # Anything else is a union tag or validator name that has no place in the YAML.
    return line, col, path


def _format_errors(exc: ValidationError, doc: Any, filename: str) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        line, col, path = _locate(doc, loc)
        field = ".".join(path) or "(top level)"
        kind = err["type"]
        if kind == "missing":
            missing = str(loc[-1])
            field = ".".join([*path, missing])
            msg = "required field is missing"
            hint = f"add '{missing}:' here"
        elif kind == "extra_forbidden":
            msg = "unknown field"
            hint = _spelling_hint(loc)
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            hint = _HINTS.get(kind, "")
        suffix = f" (hint: {hint})" if hint else ""
        problems.append(f"{filename}:{line}:{col}: {field}: {msg}{suffix}")
    return problems


def _spelling_hint(loc: tuple[Any, ...]) -> str:
    model = _model_at(Scenario, loc[:-1])
    if model is None:
        return "remove it"
    allowed = sorted(_field_names(model))
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f"did you mean '{close[0]}'? allowed here: {', '.join(allowed)}"
    return f"remove it; allowed here: {', '.join(allowed)}"


def _field_names(model: type[BaseModel]) -> dict[str, str]:
    """YAML key -> python attribute name."""
    return {(f.alias or name): name for name, f in model.model_fields.items()}


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class an error location points into (union tags and list indexes skipped)."""
    current: Any = model
    for part in loc:
        candidates = _models_in(current)
        tagged = [m for m in candidates if _tag_of(m) == part]
        if tagged:
            current = tagged[0]
            continue
        owners = [m for m in candidates if part in _field_names(m)]
        if owners:
            current = owners[0].model_fields[_field_names(owners[0])[part]].annotation
    found = _models_in(current)
    return found[0] if found else None


def _models_in(tp: Any) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in typing.get_args(tp) for m in _models_in(arg)]


def _tag_of(model: type[BaseModel]) -> str | None:
    for key in ("type", "dist", "mode"):
        f = model.model_fields.get(key)
        if f is not None:
            args = typing.get_args(f.annotation)
            if len(args) == 1:
                return str(args[0])
    return None


_HINTS = {
    "literal_error": "use one of the values listed",
    "union_tag_invalid": "use one of the values listed",
    "union_tag_not_found": "add 'type:' naming the kind of fault",
    "int_parsing": "write a whole number",
    "int_from_float": "write a whole number",
    "float_parsing": "write a number",
    "bool_parsing": "write true or false",
    "greater_than": "use a bigger value",
    "greater_than_equal": "use a bigger value",
    "less_than_equal": "use a smaller value",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list (lines starting with '- ')",
    "model_type": "write a mapping (key: value lines)",
}
