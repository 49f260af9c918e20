"""The scenario schema (pydantic v2): one validated, immutable plan. The fault union is built
from the fault catalog, so a new family needs no change here."""

from __future__ import annotations

import base64
import difflib
import functools
import re
import typing
import urllib.parse
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    field_validator,
    model_validator,
)

from streamquake.agentwire.ref import AgentRef
from streamquake.embedded.config import Protocol, TargetConfig
from streamquake.envref import ENV_REF, is_env_name, not_a_name
from streamquake.faults.catalog import fault_types
from streamquake.faults.envelope import FaultSpec, PhaseName
from streamquake.metric_catalog import ABORT_METRICS, GATING_METRICS

# Re-exported (streamquake.scenario names them): the catalog's.
from streamquake.metric_catalog import HIGHER_IS_BETTER as HIGHER_IS_BETTER
from streamquake.metric_catalog import HISTOGRAM_METRICS as HISTOGRAM_METRICS
from streamquake.metric_catalog import RATE_METRICS as RATE_METRICS
from streamquake.metric_catalog import RECOVERY_TIME as RECOVERY_TIME
from streamquake.protocols import HISTORY_FORMATS, has_history
from streamquake.scenario.network import NetworkConfig
from streamquake.scenario.steps import (
    StepSpec,
    judged_pairs,
    step_load_problems,
    timeline_problems,
)
from streamquake.units import (
    DURATION,
    MAX_USERS,
    PERCENTAGE,
    SHORTEST_S,
    DurationMs,
    DurationS,
    Fraction,
    PlainName,
    RateOrBytes,
    RequestRate,
    ScenarioModel,
    SizeOrBytes,
    Unit,
    format_duration,
    format_ms,
    format_percent,
    not_shorter_than,
    parse_duration_ms,
    parse_duration_s,
    parse_fraction,
)


def url_without_credentials(url: str) -> tuple[str, str | None]:
    """``http://user:pw@host/v1`` -> (``http://host/v1``, ``user:pw``); (url, None) without."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@", url)
    if m is None:
        return url, None
    return m.group(1) + url[m.end():], m.group(2)


SCORED_PHASES: tuple[PhaseName, ...] = ("baseline", "fault", "recovery")
PHASE_ORDER: tuple[PhaseName, ...] = ("warmup", "baseline", "fault", "recovery")

# The names each field accepts, from the metric catalog (its order is the error messages').
if TYPE_CHECKING:
    HistogramMetric = str
    Metric = str
    AbortMetric = str
else:
    HistogramMetric = Literal[HISTOGRAM_METRICS]
    Metric = Literal[GATING_METRICS]
    # Abort conditions read the live samples (run/watch.py), which hold requests, not the
    # arrivals that were never sent, nor a schedule-based E2E: the metrics measured there.
    AbortMetric = Literal[ABORT_METRICS]


class TargetSpec(ScenarioModel):
    protocol: Protocol
    model: PlainName = "sim-1"
    url: str | None = None
    embedded: TargetConfig | None = None
    path: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    verify_tls: bool = True
    timeout_s: DurationS = Field(default=60.0, alias="timeout", gt=0)
    connect_timeout_s: DurationS = Field(default=5.0, alias="connect_timeout", gt=0)
    # One real streaming request per class before the load (run/probe.py); false skips it, for
    # a target that is meant to fail.
    probe: bool = True

    @model_validator(mode="before")
    @classmethod
    def _url_credentials(cls, data: object) -> object:
        """``http://user:KEY@host``: the credentials leave the URL for an ``Authorization:
        Basic`` header (what curl and browsers send for them), so that every report, plan and
        log that names the URL names it without them, and the header is redacted as any is."""
        if not isinstance(data, dict) or not isinstance(url := data.get("url"), str):
            return data
        base, creds = url_without_credentials(url)
        if creds is None:
            return data
        headers = data.get("headers") or {}
        if not isinstance(headers, dict):
            return data          # the headers' own error says what is wrong
        if any(str(k).lower() == "authorization" for k in headers):
            raise ValueError("url: the URL holds credentials (user:password@) and headers "
                             "has an Authorization header too: give them once, in headers")
        if ENV_REF.search(creds):
            raise ValueError("url: credentials in the URL (user:password@) cannot use "
                             "${VAR}: give them as a header instead, e.g. headers: "
                             "{Authorization: \"Basic ${CREDENTIALS_BASE64}\"}")
        token = base64.b64encode(urllib.parse.unquote(creds).encode()).decode()
        return {**data, "url": base, "headers": {**headers, "Authorization": f"Basic {token}"}}

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/]+", v):
            raise ValueError(
                "must start with http:// or https:// and name a host, e.g. http://127.0.0.1:8000"
            )
        return v.rstrip("/") if v else v

    @field_validator("headers", "path")
    @classmethod
    def _env_refs(cls, v: dict[str, str] | str | None) -> dict[str, str] | str | None:
        for value in (v or {}).values() if isinstance(v, dict) else [v or ""]:
            for name in ENV_REF.findall(value):
                if not is_env_name(name):
                    raise ValueError(not_a_name(name))
        return v

    @field_validator("path")
    @classmethod
    def _request_path(cls, v: str | None) -> str | None:
        bad = next((c for c in v or "" if c <= " " or c == "\x7f"), None)
        if bad is not None:
            raise ValueError(f"{v!r} holds {bad!r}, which a request path cannot: percent-encode "
                             "it (a space is %20) or remove it, e.g. /v1/chat/completions")
        if v is not None and v.startswith("//"):
            raise ValueError(f"{v!r} starts with '//', which names a host, not a path: write "
                             "one '/', e.g. /v1/chat/completions")
        return v

    @field_validator("headers")
    @classmethod
    def _no_traceparent(cls, v: dict[str, str]) -> dict[str, str]:
        if any(name.lower() == "traceparent" for name in v):
            raise ValueError("'traceparent' is streamquake's own: every request carries a fresh "
                             "W3C traceparent, whose trace id each sample keeps (trace_id); "
                             "remove this header")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> TargetSpec:
        if (self.url is None) == (self.embedded is None):
            raise ValueError(
                "give exactly one of 'url' (a running endpoint) or 'embedded' (the simulated "
                "server, e.g. 'embedded: {}')"
            )
        return self


class ThinkTime(ScenarioModel):
    min_s: DurationS = Field(default=0.0, alias="min", ge=0)
    max_s: DurationS = Field(default=0.0, alias="max", ge=0)

    @model_validator(mode="after")
    def _order(self) -> ThinkTime:
        if self.max_s < self.min_s:
            raise ValueError("'max' must not be smaller than 'min'")
        return self


class Arrival(ScenarioModel):
    rate_per_s: RequestRate = Field(alias="rate", gt=0)
    process: Literal["constant", "poisson"] = "poisson"
    max_inflight: int = Field(default=1000, ge=1)


class TraceSpec(ScenarioModel):
    """Replay a recorded trace (loadgen/trace.py reads Mooncake and Azure shapes): each row is
    sent at its own time from the start of the run, with its own prompt and output lengths."""

    file: str
    speedup: float = Field(default=1.0, gt=0)
    loop: bool = False           # start the trace again when it runs out before the run ends
    max_inflight: int = Field(default=1000, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, v: object) -> object:
        return {"file": v} if isinstance(v, str) else v


def threshold_text(metric: str, value: float) -> str:
    """A threshold in its metric's unit, as a scenario writes it: ``1%``, ``350ms``, ``10s``."""
    if metric in RATE_METRICS:
        return format_percent(value)
    if metric == RECOVERY_TIME:
        return format_duration(value)
    return format_ms(value) if metric.endswith("_ms") else f"{value:g}"


def _threshold_value(v: object) -> object:
    """A threshold as written: rates as percentages ("1%"), ms metrics as durations ("350ms")."""
    if isinstance(v, str) and v.strip().endswith("%"):
        return parse_fraction(v)
    if isinstance(v, str):
        return parse_duration_ms(v)
    return v


Threshold = Annotated[float, Unit(PERCENTAGE.kinds + DURATION.kinds),
                      BeforeValidator(_threshold_value)]


class AbortCondition(ScenarioModel):
    """``{metric: error_rate, above: 50%, for: 10s}``: stop the damage when it holds.

    Evaluated every half second over the requests that ended in the trailing ``for`` window
    (at least ``min_requests`` of them); when it holds, every fault is reverted at once, no other
    fault is applied, the remaining phases (recovery among them) still run and are reported,
    and the run is marked aborted with the reason (exit 5).
    """

    metric: AbortMetric
    percentile: float | None = Field(default=None, gt=0, le=100)
    above: Threshold
    for_s: DurationS = Field(default=10.0, alias="for", gt=0)
    min_requests: int = Field(default=5, ge=1)

    @model_validator(mode="after")
    def _shape(self) -> AbortCondition:
        if self.metric in HISTOGRAM_METRICS and self.percentile is None:
            raise ValueError(f"'{self.metric}' is a distribution: add 'percentile', e.g. 95")
        if self.metric in RATE_METRICS and self.percentile is not None:
            raise ValueError(f"'{self.metric}' is a rate over the window: remove 'percentile'")
        return self

    @property
    def label(self) -> str:
        what = f"{self.metric} p{self.percentile:g}" if self.percentile else self.metric
        return (f"{what} above {threshold_text(self.metric, self.above)} for "
                f"{format_duration(self.for_s)}")


class VerdictSpec(ScenarioModel):
    """How sure a verdict must be. Every percentile and rate comes with a ``confidence``
    interval (order statistics; Wilson for rates; widened by batch means over time, so it
    holds for requests that queue behind each other); a check whose interval straddles its
    threshold is *inconclusive*, and ``inconclusive`` says how that gates: ``warn`` (the
    observed value decides, and the report says it is inconclusive), ``fail`` or ``pass``.
    An SLO whose metric cannot be measured against this target (``chunk_loss`` from a server
    that numbers no events, an open-loop metric in a closed loop) is *not measurable*, and
    ``unmeasurable`` says how that gates: ``warn`` (reported, not failed), ``fail`` or ``pass``.
    A metric with no data because requests failed is not that: it fails.
    A timing check (a percentile, ``stall_rate``, ``recovery_time_s``, a recovery comparison)
    in a step whose load generator was saturated (run/saturation.py) is *not judged*: its
    timings are the client's as much as the server's. ``saturated`` says how that gates:
    ``not_judged`` (the run exits 6 when nothing else broke), ``fail`` (exit 1) or ``warn``
    (shown, not gating). Errors and counts are judged whatever the client's load."""

    confidence: Fraction = Field(default=0.95, gt=0.5, lt=1.0)
    inconclusive: Literal["warn", "fail", "pass"] = "warn"
    unmeasurable: Literal["warn", "fail", "pass"] = "warn"
    saturated: Literal["not_judged", "fail", "warn"] = "not_judged"


_SHORT_SLO = re.compile(r"(?P<metric>[a-z_]+)\s*:?\s*(?:p\(?(?P<pct>\d+(?:\.\d+)?)\)?\s*)?"
                        r"(?P<op><=|>=|<|>)\s*(?P<value>[^<>=]+)")


class SLOSpec(ScenarioModel):
    metric: Metric
    percentile: float | None = Field(default=None, gt=0, le=100)
    max: Threshold | None = None
    min: Threshold | None = None
    # Where it gates: step names or kinds (``phases: [baseline, recovery]`` means every step of
    # those kinds; with ``phases:`` the steps are named as their kinds).
    phases: list[PlainName] = Field(default_factory=lambda: [str(p) for p in SCORED_PHASES])
    name: PlainName | None = None

    @model_validator(mode="before")
    @classmethod
    def _seconds(cls, data: object) -> object:
        # recovery_time_s is in seconds: "5s" is 5, and a bare number is seconds.
        if isinstance(data, dict) and data.get("metric") == RECOVERY_TIME:
            return {k: parse_duration_s(v) if k in ("max", "min") and isinstance(v, str) else v
                    for k, v in data.items()}
        return data

    @model_validator(mode="before")
    @classmethod
    def _unit_fits(cls, data: object) -> object:
        """A threshold in its metric's unit: a rate as a percentage (a bare number is a
        fraction, so ``max: 1`` would be 100%, an SLO that never breaks, and ``max: 5`` 500%),
        a time as a duration."""
        if not isinstance(data, dict) or not isinstance(metric := data.get("metric"), str):
            return data
        for key in ("max", "min"):
            v = data.get(key)
            if metric in RATE_METRICS:
                if isinstance(v, str) and not v.strip().endswith("%"):
                    raise ValueError(f"{key}: '{metric}' is a rate: write a percentage, e.g. "
                                     f"{key}: 1%")
                if isinstance(v, int | float) and not isinstance(v, bool) and v >= 1:
                    raise ValueError(
                        f"{key}: {v:g} is read as a fraction, {v:.0%} of requests"
                        f"{', which never breaks' if key == 'max' else ''}: write "
                        f"{v:g}% for {v:g} percent (a bare number is a fraction: "
                        f"{v / 100:g}), or 100% if that is meant")
            elif metric.endswith("_ms") and isinstance(v, str) and v.strip().endswith("%"):
                raise ValueError(f"{key}: '{metric}' is a time: write a duration, e.g. "
                                 f"{key}: 350ms")
        return data

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, data: object) -> object:
        """(Defined last: pydantic runs "before" validators last-defined first.) k6's
        threshold strings as a short form: ``"ttft_ms p95 < 350ms"``, ``"ttft_ms:
        p(95)<350ms"``, ``"error_rate < 1%"`` (``<`` and ``<=`` both mean ``max``, ``>`` and
        ``>=`` ``min``: a limit is met at equality here, as in the long form)."""
        if not isinstance(data, str):
            return data
        m = _SHORT_SLO.fullmatch(data.strip())
        if m is None:
            raise ValueError(f"{data[:80]!r}: write an SLO as a mapping, e.g. {{metric: ttft_ms, "
                             "percentile: 95, max: 350ms}, or in short as \"ttft_ms p95 < 350ms\"")
        out: dict[str, object] = {"metric": m["metric"],
                                  "max" if m["op"].startswith("<") else "min": m["value"].strip()}
        if m["pct"] is not None:
            out["percentile"] = float(m["pct"])
        return out

    @model_validator(mode="after")
    def _shape(self) -> SLOSpec:
        if (self.max is None) == (self.min is None):
            raise ValueError("give exactly one threshold: 'max' (must stay below) or 'min'")
        if self.metric == RECOVERY_TIME and self.percentile is not None:
            raise ValueError("'recovery_time_s' is one time per fault: remove 'percentile'")
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
        op, limit = ("<=", self.max) if self.max is not None else (">=", self.min)
        return f"{what} {op} {threshold_text(self.metric, limit or 0.0)}"


class ReadSpec(ScenarioModel):
    """A slow consumer: the class reads its streams at most ``rate`` body bytes a second
    (``2kB/s``, ``16kbit``), and/or pauses ``pause`` after every ``every`` events, on
    connections of its own whose receive buffer is ``receive_buffer`` (SO_RCVBUF, before the
    connect; the kernel doubles it and keeps its own minimum), so that the server's writes
    back up (docs/measurement.md, "A slow consumer")."""

    rate_bytes_per_s: RateOrBytes | None = Field(default=None, alias="rate", gt=0)
    pause_s: DurationS = Field(default=0.0, alias="pause", ge=0)
    every: int = Field(default=1, ge=1)
    receive_buffer: SizeOrBytes | None = Field(default=None, ge=1)

    @field_validator("every", mode="before")
    @classmethod
    def _events(cls, v: object) -> object:
        # "10 events" reads as it is meant; a bare number too.
        if isinstance(v, str) and (m := re.fullmatch(r"\s*([0-9]+)\s*(events?)?\s*", v)):
            return int(m[1])
        return v

    @model_validator(mode="after")
    def _something(self) -> ReadSpec:
        if self.rate_bytes_per_s is None and not self.pause_s and self.receive_buffer is None:
            raise ValueError("give a 'rate' (e.g. 2kB/s), a 'pause' (with 'every' N events) "
                             "or a 'receive_buffer' (e.g. 4KiB)")
        if "every" in self.model_fields_set and not self.pause_s:
            raise ValueError("'every' says how often to 'pause': give a 'pause' too")
        return self


class CancelSpec(ScenarioModel):
    """Client cancellations: a ``share`` of the class's streams (drawn from ``load.seed``) is
    closed by the client, as a user closes a tab or presses stop, ``after`` a time from the
    request's start (``500ms``) or at its ``after_tokens``-th content event. A cancelled
    stream is neither a success nor an error: it is counted apart (``cancelled``), its TTFB
    and TTFT count if they came before the close, its E2E and tokens do not."""

    share: Fraction = Field(gt=0, le=1)
    after_ms: DurationMs | None = Field(default=None, alias="after", gt=0)
    after_tokens: int | None = Field(default=None, ge=1)

    @field_validator("after_tokens", mode="before")
    @classmethod
    def _tokens(cls, v: object) -> object:
        # "5 tokens" reads as it is meant; a bare number too.
        if isinstance(v, str) and (m := re.fullmatch(r"\s*([0-9]+)\s*(tokens?)?\s*", v)):
            return int(m[1])
        return v

    @model_validator(mode="after")
    def _one_point(self) -> CancelSpec:
        if (self.after_ms is None) == (self.after_tokens is None):
            raise ValueError("give exactly one of 'after' (a time from the request's start, "
                             "e.g. 500ms) or 'after_tokens' (a count of content events, e.g. 5)")
        return self


class ConversationSpec(ScenarioModel):
    """A session of ``turns`` requests whose history grows: turn k sends ``system_prefix`` (the
    same in every session, so a prefix cache can keep it), the earlier turns' prompts and the
    answers received, then the class's k-th prompt (its prompts in order, round again when
    fewer). ``think_time`` waits between a turn's answer and the next turn. A session fails at
    its first failed turn and stops there. ``system_prefix``: a text, or a count of tokens
    (``300 tokens``, or a number) for a seeded text of that many words."""

    turns: int = Field(ge=1, le=1000)
    think_time: ThinkTime = Field(default_factory=ThinkTime)
    system_prefix: str | int = ""

    @field_validator("think_time", mode="before")
    @classmethod
    def _one_time(cls, v: object) -> object:
        # A single duration ("1s") waits that long every time.
        return {"min": v, "max": v} if isinstance(v, str | int | float) else v

    @field_validator("system_prefix", mode="before")
    @classmethod
    def _tokens(cls, v: object) -> object:
        if isinstance(v, bool):
            raise ValueError("give a text, or a count of tokens such as '300 tokens'")
        if isinstance(v, str) and (m := re.fullmatch(r"\s*([0-9]+)\s*tokens?\s*", v)):
            v = int(m[1])
        if isinstance(v, int) and not 1 <= v <= 100_000:
            raise ValueError(f"a system prefix of {v} tokens: give 1 to 100000 tokens, or a "
                             "text")
        return v


class RequestClass(ScenarioModel):
    name: PlainName = "default"
    weight: float = Field(default=1.0, gt=0, le=1e6)
    prompt: str | None = None
    prompts: list[str] | None = None
    dataset: str | None = None     # a JSONL/CSV file of prompts (and max_tokens), loadgen/trace.py
    max_tokens: int = Field(default=64, ge=1)
    body: dict[str, JsonValue] | None = None
    # vLLM's body field `priority` (0 served first, with --scheduling-policy priority): P0-P3.
    priority: int | None = Field(default=None, ge=0, le=3)
    slos: list[SLOSpec] = Field(default_factory=list)
    read: ReadSpec | None = None   # a slow consumer; none: read as fast as the stream comes
    cancel: CancelSpec | None = None   # a share of streams the client abandons early
    # sessions of turns whose history grows (each turn sends the answers before it back)
    conversation: ConversationSpec | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestClass:
        given = [k for k in ("prompt", "prompts", "dataset") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of 'prompt', 'prompts' or 'dataset', not "
                             f"{' and '.join(repr(g) for g in given)}")
        if self.priority is not None and self.body is not None and "priority" in self.body:
            raise ValueError("priority: the class's 'body' has a 'priority' too: give it once, "
                             "in 'priority' or in 'body'")
        return self

    @property
    def prompt_list(self) -> list[str]:
        if self.prompts:
            return list(self.prompts)
        return [self.prompt or "Say something."]


class StreamLimits(ScenarioModel):
    """How much one stream may make the load generator hold (loadgen/sse_parser.py has the reasons
    for the defaults); a stream that breaks one fails as error kind ``limit``."""

    line_bytes: SizeOrBytes = Field(default=1 << 20, alias="line", ge=1024)
    event_bytes: SizeOrBytes = Field(default=4 << 20, alias="event", ge=1024)
    data_lines: int = Field(default=65_536, ge=16)


class LoadSpec(ScenarioModel):
    users: int = Field(default=1, ge=1, le=MAX_USERS)
    spawn_rate: float = Field(default=0.0, ge=0, le=1e7,
                              description="users started per second; 0 = all")
    think_time: ThinkTime | None = None
    arrival: Arrival | None = None
    trace: TraceSpec | None = None
    classes: list[RequestClass] = Field(default_factory=lambda: [RequestClass()])
    stall_threshold_ms: DurationMs = Field(default=250.0, alias="stall_threshold", gt=0)
    workers: int = Field(default=0, ge=0, description="Locust worker processes; 0 = one process")
    # Workers on other hosts (`streamquake worker --master HOST:PORT`): the master waits for this
    # many to join, on master_bind, and sends each the plan (loadgen/relay.py).
    remote_workers: int = Field(default=0, ge=0)
    master_bind: str = Field(default="127.0.0.1:5557",
                             pattern=r"^([^\s:\[\]]+|\[[0-9a-fA-F:.]+\]):[0-9]{1,5}$")
    seed: int = 0
    # none, or the seed manual's policy (loadgen/retry.py): 5xx and connect errors get up to 2
    # retries with exponential backoff, a 429 one retry after 100 ms or its Retry-After.
    retries: Literal["none", "standard"] = "none"
    limits: StreamLimits = Field(default_factory=StreamLimits)
    # A load generator too busy to keep up (run/saturation.py has the thresholds): warn in
    # every report, or also fail the gate in each measured phase where it was.
    saturation: Literal["warn", "fail"] = "warn"
    # The verdicts come from each load process's scorecard (merged HDR histograms); raw
    # per-request lines are extra: samples.csv, compare's confidence intervals, the live view's
    # rolling figures and abort conditions read them. "none" writes (and relays) none.
    samples: Literal["all", "none"] = "all"

    @model_validator(mode="after")
    def _loop(self) -> LoadSpec:
        if self.think_time is not None and self.arrival is not None:
            raise ValueError(
                "give 'think_time' (closed loop) or 'arrival' (open loop), not both"
            )
        if self.trace is not None and (self.think_time is not None or self.arrival is not None):
            raise ValueError("a 'trace' sets its own arrival times: remove 'think_time' and "
                             "'arrival'")
        names = [c.name for c in self.classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"request class names must be unique; repeated: {', '.join(dupes)}")
        return self


PhaseS = Annotated[DurationS, not_shorter_than(SHORTEST_S, "a phase", zero_leaves_out=True)]


class PhasesSpec(ScenarioModel):
    warmup_s: PhaseS = Field(default=0.0, alias="warmup", ge=0)
    baseline_s: Annotated[DurationS, not_shorter_than(SHORTEST_S, "the baseline")] = Field(
        alias="baseline", gt=0)
    fault_s: PhaseS = Field(alias="fault", ge=0)
    recovery_s: PhaseS = Field(alias="recovery", ge=0)

    def duration_s(self, phase: str) -> float:
        return float(getattr(self, f"{phase}_s"))

    @property
    def total_s(self) -> float:
        return sum(self.duration_s(p) for p in PHASE_ORDER)


class RecoverySpec(ScenarioModel):
    """Recovery must come back to within ``tolerance`` of baseline (plus an absolute slack)."""

    tolerance: Fraction = 0.10
    percentile: float = Field(default=95.0, gt=0, le=100)
    metrics: list[HistogramMetric] = Field(
        default_factory=lambda: typing.cast(list[HistogramMetric], ["ttft_ms", "itl_ms"])
    )
    slack_ms: DurationMs = Field(default=5.0, alias="slack", ge=0)
    # Time to recovery (run/recovery_time.py): the requests due in each window this long.
    window_s: Annotated[DurationS, not_shorter_than(SHORTEST_S, "a recovery window")] = Field(
        default=2.0, alias="window", gt=0)


def _fault_union() -> object:
    specs = tuple(t.spec for t in fault_types().values())
    if len(specs) == 1:
        return specs[0]
    return Annotated[typing.Union[specs], Field(discriminator="type")]  # noqa: UP007


if TYPE_CHECKING:
    FaultModel = FaultSpec
else:
    FaultModel = _fault_union()


class Scenario(ScenarioModel):
    # Exactly one of the two timelines; editors reading the JSON schema see it too.
    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["phases"]}, {"required": ["steps"]}]})

    name: PlainName
    description: str = ""
    target: TargetSpec
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    load: LoadSpec = Field(default_factory=LoadSpec)
    phases: PhasesSpec | None = None
    faults: list[FaultModel] = Field(default_factory=list)
    steps: list[StepSpec] | None = None
    slos: list[SLOSpec] = Field(default_factory=list)
    recovery: RecoverySpec | None = None
    verdicts: VerdictSpec = Field(default_factory=VerdictSpec)
    agents: list[AgentRef] = Field(default_factory=list)
    abort_when: list[AbortCondition] = Field(default_factory=list)

    @field_validator("abort_when")
    @classmethod
    def _live_samples(cls, v: list[AbortCondition], info: ValidationInfo
                      ) -> list[AbortCondition]:
        load = info.data.get("load")
        if v and isinstance(load, LoadSpec) and load.samples == "none":
            raise ValueError("abort_when reads the live per-request samples, and load.samples "
                             "is 'none': set load.samples to 'all' or remove abort_when")
        return v

    @model_validator(mode="after")
    def _agents_named(self) -> Scenario:
        names = [a.name for a in self.agents]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"give each agent a unique 'name'; repeated: {', '.join(dupes)}")
        for f in self.faults:
            if f.at is not None and f.at not in names:
                known = ", ".join(names) if names else "none"
                raise ValueError(f"fault '{f.label}' runs at '{f.at}', but `agents` lists no "
                                 f"agent of that name (listed: {known}); add it there or use "
                                 "`at: local`")
        return self

    @model_validator(mode="after")
    def _conversations_have_history(self) -> Scenario:
        for i, c in enumerate(self.load.classes):
            if c.conversation is not None and c.body is not None:
                raise ValueError(f"load.classes.{i}.conversation: the class's 'body' is sent as "
                                 "it is, with no history to grow: give the turns' prompts in "
                                 "'prompts' instead of 'body'")
            if c.conversation is None or has_history(self.target.protocol, self.target.path):
                continue
            what = ("legacy completions (target.path " + repr(self.target.path) + ")"
                    if self.target.protocol == "openai" else f"'{self.target.protocol}'")
            raise ValueError(
                f"load.classes.{i}.conversation: {what} requests take one prompt, no message "
                "history to send the earlier turns in; formats with one: "
                f"{', '.join(HISTORY_FORMATS)} (OpenAI's chat path), or remove 'conversation'")
        return self

    @field_validator("steps")
    @classmethod
    def _whole_timeline(cls, v: list[StepSpec] | None, info: ValidationInfo
                        ) -> list[StepSpec] | None:
        faults = info.data.get("faults")
        if v is None or not isinstance(faults, list):
            return v
        problems = timeline_problems(v, [f.label for f in faults])
        problems += [f"fault '{f.label}': its steps say when it runs: remove 'phase: "
                     f"{f.phase}'" for f in faults if "phase" in f.model_fields_set]
        load = info.data.get("load")
        if isinstance(load, LoadSpec):
            problems += step_load_problems(v, "trace" if load.trace is not None else
                                           "open" if load.arrival is not None else "closed")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _slo_steps(self) -> Scenario:
        if (self.phases is None) == (self.steps is None):
            return self         # _consistent says which to give
        steps = {s.name: s.kind for s in self.timeline}
        kinds = ("baseline", "fault", "recovery")
        slos = [(f"slos.{i}", slo) for i, slo in enumerate(self.slos)]
        slos += [(f"load.classes.{i}.slos.{j}", slo) for i, rc in enumerate(self.load.classes)
                 for j, slo in enumerate(rc.slos)]
        for where, slo in slos:
            for k, name in enumerate(slo.phases):
                if steps.get(name) == "warmup":
                    raise ValueError(f"{where}.phases.{k}: warm-up is never scored: name "
                                     "baseline, fault or recovery steps")
                if name not in kinds and name not in steps:
                    scored = [s for s in steps if steps[s] != "warmup"]
                    named = f"; steps: {', '.join(scored)}" if self.steps is not None else ""
                    close = difflib.get_close_matches(name, [*kinds, *scored], n=1)
                    guess = f"did you mean '{close[0]}'? " if close else ""
                    raise ValueError(f"{where}.phases.{k}: '{name}' is no step and no kind: "
                                     f"{guess}(kinds: {', '.join(kinds)}{named})")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        if (self.phases is None) == (self.steps is None):
            raise ValueError("give either 'phases' (warmup, baseline, fault, recovery) or "
                             "'steps' (a list of named steps), not both" if self.phases else
                             "give 'phases' (e.g. {baseline: 30s, fault: 30s, recovery: 30s}) "
                             "or 'steps' (a list of named steps)")
        labels = [f.label for f in self.faults]
        dupes = sorted({n for n in labels if labels.count(n) > 1})
        if dupes:
            raise ValueError(f"give each fault a unique 'name'; repeated: {', '.join(dupes)}")
        for f in self.faults:
            steps = [s for s in self.timeline if f.label in s.faults]
            if self.phases is not None and not steps:
                raise ValueError(f"fault '{f.label}' lives in phase '{f.phase}', which lasts 0 s")
            shortest = min((s.duration_s for s in steps), default=0.0)
            if f.flap is not None and (first := f.flap.shortest_s(f.flap.start)) >= shortest:
                where = (f"its phase '{f.phase}'" if self.phases is not None
                         else "its shortest step")
                raise ValueError(
                    f"fault '{f.label}' flaps, but its first state ({f.flap.start}, at least "
                    f"{first:g}s) fills {where} ({shortest:g}s): it would never switch; "
                    f"shorten flap.{f.flap.start} or leave flap out")
        return self

    @functools.cached_property
    def judged(self) -> tuple[tuple[StepSpec | None, StepSpec, StepSpec | None], ...]:
        """Each fault step with the baseline step before it and the recovery step after it
        (``steps.judged_pairs``), worked out once: the verdicts, time to recovery and the run's
        result all read these."""
        return tuple(judged_pairs(self.timeline))

    @functools.cached_property
    def timeline(self) -> tuple[StepSpec, ...]:
        """The run's steps, in order: ``steps`` as given, or the four ``phases`` as the steps
        named as their kinds (a zero duration leaves a step out), each fault in the step its
        ``phase`` names."""
        if self.steps is not None:
            return tuple(self.steps)
        assert self.phases is not None
        return tuple(
            StepSpec.model_construct(
                name=p, kind=p, duration_s=self.phases.duration_s(p),
                faults=tuple(f.label for f in self.faults if f.phase == p), load=None)
            for p in PHASE_ORDER if self.phases.duration_s(p) > 0)

    @property
    def total_s(self) -> float:
        """The timeline's length, every step."""
        return sum(s.duration_s for s in self.timeline)

    def step(self, name: str) -> StepSpec | None:
        return next((s for s in self.timeline if s.name == name), None)


