"""OpenTelemetry out (``run --otlp URL``): the finished run, sent once to an OTLP/HTTP endpoint
(protobuf, ``POST URL/v1/traces`` and ``URL/v1/metrics``).

Sent after the run, from the runner's side, from the per-request samples the load processes
already wrote: nothing is exported from a load process, whose event loop is the measurement.

* **Traces**: one CLIENT span per request attempt, in the trace of the W3C ``traceparent`` that
  attempt was sent with (``RequestSample.trace_id``), so a server that records that header puts
  its own spans in the same trace, under this one: the span's id is the header's span id
  (``RequestSample.span_id``; a fresh one for a sample written before it was kept).
  Start is when the request's last byte was written (``sent``), end that plus ``e2e_ms`` (the
  stream's end, its failure, or the timeout that cut it). Attribute names follow the GenAI
  semantic conventions (``gen_ai.*``, ``server.*``, ``error.type``); streamquake's own are
  ``streamquake.*``: the step the request counts in (the report's rule), the faults the scenario
  runs in that step, the request class. Events: the first byte, the first token, and every fault
  apply or revert (flapping edges too) that happened while the request was in flight.
* **Metrics**: per step (and class), the GenAI client histograms
  ``gen_ai.client.operation.duration``, ``gen_ai.client.token.usage`` (output tokens of
  successful requests), ``gen_ai.client.operation.time_to_first_chunk`` (TTFT) and
  ``gen_ai.client.operation.time_per_output_chunk`` (each inter-token gap), over the requests
  the report counts in that step: retried attempts are counted apart there, and left out here.

A failed export is a warning, never a changed verdict or exit code: :func:`export_run` returns
what went wrong as sentences and raises nothing for the network's sake. Traffic goes only to the
URL given: no proxy from the environment, no redirect followed.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Histogram,
    HistogramDataPoint,
    Metric,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from streamquake.errors import ScenarioError
from streamquake.loadgen.attribution import due_at, window_at
from streamquake.loadgen.samples import RequestSample
from streamquake.protocols.openai import is_legacy_path
from streamquake.reports.csv_report import iter_samples
from streamquake.result import PhaseResult, RunResult

TIMEOUT_S = 10.0             # each POST
DEADLINE_S = 60.0            # the whole export: no batch starts after it
SPANS_PER_POST = 2000        # ~1-2 MB a request, well under receivers' usual body limits
DETAIL_MAX = 256             # characters of a failure's (redacted) reason in a span's status

# Explicit bucket boundaries the GenAI conventions give (semantic-conventions v1.41.0,
# docs/gen-ai/gen-ai-metrics.md): seconds for the three times, tokens for usage.
TIME_BOUNDS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                 40.96, 81.92)
TOKEN_BOUNDS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                16777216, 67108864)

DURATION = "gen_ai.client.operation.duration"
TOKEN_USAGE = "gen_ai.client.token.usage"
TIME_TO_FIRST_CHUNK = "gen_ai.client.operation.time_to_first_chunk"
TIME_PER_OUTPUT_CHUNK = "gen_ai.client.operation.time_per_output_chunk"
_METRICS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    DURATION: ("GenAI operation duration.", "s", TIME_BOUNDS_S),
    TOKEN_USAGE: ("Number of input and output tokens used.", "{token}", TOKEN_BOUNDS),
    TIME_TO_FIRST_CHUNK: ("Time to receive the first chunk, measured from when the client "
                          "issues the generation request to when the first chunk is received "
                          "in the response stream.", "s", TIME_BOUNDS_S),
    TIME_PER_OUTPUT_CHUNK: ("Time per output chunk, recorded for each chunk received after "
                            "the first one.", "s", TIME_BOUNDS_S),
}

# gen_ai.provider.name and gen_ai.operation.name by wire format: the conventions' well-known
# values where one fits, the wire format's own name where none does.
_PROVIDER = {"openai": "openai", "openai_responses": "openai", "anthropic": "anthropic",
             "gemini": "gcp.gemini", "llama_cpp": "llama_cpp", "sse": "sse"}
_OPERATION = {"gemini": "generate_content", "llama_cpp": "text_completion"}

Attr = str | int | float | bool | list[str]


@dataclass
class Exported:
    """What one export sent, and what went wrong (sentences, for the report's warnings)."""

    url: str
    spans: int = 0
    points: int = 0
    requests: int = 0           # samples read
    problems: list[str] = field(default_factory=list)
    no_samples: bool = False    # the run kept no per-request samples (load.samples: none)


def otlp_endpoint(url: str) -> str:
    """``--otlp URL`` checked: ``http(s)://host[:port][/path]`` without credentials; returned
    without a trailing ``/`` (``/v1/traces`` and ``/v1/metrics`` are added to it)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ScenarioError(f"--otlp {url}: give an OTLP/HTTP endpoint such as "
                            "http://127.0.0.1:4318 (/v1/traces and /v1/metrics are added)")
    if parts.username is not None or parts.password is not None:
        raise ScenarioError(f"--otlp {parts.scheme}://...@{parts.hostname}: the URL holds "
                            "credentials, which would be sent in the clear; give none")
    if parts.query or parts.fragment:
        raise ScenarioError(f"--otlp {url}: give the endpoint without a query (?...) or "
                            "fragment (#...): /v1/traces and /v1/metrics are added to its path")
    return url.rstrip("/")


def export_run(result: RunResult, samples_dir: os.PathLike[str] | str, url: str,
               redact: Callable[[str], str] | None = None,
               timeout_s: float = TIMEOUT_S) -> Exported:
    """Send the run's spans (in batches) and its per-step metrics to ``url``. ``redact`` cleans
    a failure's reason before it leaves (without one, no reason text is sent). Never raises for
    the network or the receiver: each problem is a sentence in the result."""
    ctx = _Context.of(result, redact)
    out = Exported(url)
    sender = _Sender(url, timeout_s, time.monotonic() + DEADLINE_S)
    samples: Iterator[RequestSample] = iter(())
    folder = Path(samples_dir)
    if folder.is_dir() and result.phases:
        samples = iter_samples(folder, result.started_at)
    load = result.scenario_echo.get("load")
    out.no_samples = isinstance(load, dict) and load.get("samples") == "none"
    batch: list[Span] = []

    def flush() -> None:
        if batch and sender.traces(ctx.traces(batch)):
            out.spans += len(batch)
        batch.clear()

    try:
        for s in samples:
            out.requests += 1
            ctx.measure(s)
            if not sender.broken:
                batch.append(ctx.span(s))
                if len(batch) >= SPANS_PER_POST:
                    flush()
        flush()
        points = ctx.metrics()
        n_points = sum(len(m.histogram.data_points) for rm in points.resource_metrics
                       for sm in rm.scope_metrics for m in sm.metrics)
        if n_points and not sender.broken and sender.metrics(points):
            out.points = n_points
    except KeyboardInterrupt:
        sender.problems.append("interrupted (Ctrl-C)")
    if sender.problems:
        out.problems.append(
            f"OTLP export to {url} failed: {'; '.join(sender.problems)}; sent "
            f"{out.spans} of {out.requests} spans and {out.points} metric points "
            "(the verdict and the reports do not depend on it)")
    return out


# -- what the spans and points say -----------------------------------------------------------


@dataclass(frozen=True)
class _Edge:
    at: float
    name: str                   # streamquake.fault.applied | streamquake.fault.reverted
    attrs: dict[str, Attr]


class _Hist:
    __slots__ = ("bounds", "counts", "count", "sum", "min", "max")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")

    def add(self, value: float) -> None:
        # OTLP buckets are (bounds[i-1], bounds[i]]: bisect_left finds that i.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)


@dataclass
class _Context:
    """What every span and point of one run shares, and the per-step histograms."""

    result: RunResult
    redact: Callable[[str], str] | None
    common: dict[str, Attr]
    model: str
    max_tokens: dict[str, int]
    steps: dict[str, PhaseResult]
    edges: list[_Edge]
    hists: dict[tuple[str, str, str, str], _Hist] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)     # step -> its last request's end

    @classmethod
    def of(cls, result: RunResult, redact: Callable[[str], str] | None) -> _Context:
        target = result.scenario_echo.get("target")
        target = target if isinstance(target, dict) else {}
        protocol = str(target.get("protocol") or "")
        path = target.get("path")
        operation = ("text_completion" if protocol == "openai" and isinstance(path, str)
                     and is_legacy_path(path) else _OPERATION.get(protocol, "chat"))
        model = str(target.get("model") or "")
        common: dict[str, Attr] = {"gen_ai.operation.name": operation,
                                   "gen_ai.provider.name": _PROVIDER.get(protocol, protocol)}
        if model:
            common["gen_ai.request.model"] = model
        server = urllib.parse.urlsplit(str(result.target.get("url") or ""))
        if server.hostname:
            common["server.address"] = server.hostname
            with contextlib.suppress(ValueError):     # a port that is no number: none
                common["server.port"] = server.port or (443 if server.scheme == "https" else 80)
        load = result.scenario_echo.get("load")
        classes = load.get("classes") if isinstance(load, dict) else None
        max_tokens = {str(c.get("name")): cap
                      for c in (classes if isinstance(classes, list) else [])
                      if isinstance(c, dict) and isinstance(cap := c.get("max_tokens"), int)}
        return cls(result, redact, common, model, max_tokens,
                   {p.name: p for p in result.phases}, _edges(result))

    def step_of(self, s: RequestSample) -> PhaseResult | None:
        home = window_at(due_at(s), self.result.phases)
        return None if home is None else self.steps[home.name]

    # -- spans

    def span(self, s: RequestSample) -> Span:
        start = _ns(s.sent)
        end = start + _ms_ns(_end_ms(s))
        attrs: dict[str, Attr] = dict(self.common)
        attrs["gen_ai.request.stream"] = True
        if s.cls in self.max_tokens:
            attrs["gen_ai.request.max_tokens"] = self.max_tokens[s.cls]
        if s.model:
            attrs["gen_ai.response.model"] = s.model
        if s.response_id:
            attrs["gen_ai.response.id"] = s.response_id
        if s.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [s.finish_reason]
        if s.output_tokens or s.usage_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = s.output_tokens
        if s.reasoning_tokens is not None:
            attrs["gen_ai.usage.reasoning.output_tokens"] = s.reasoning_tokens
        if s.ttft_ms is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = s.ttft_ms / 1000.0
        if s.status is not None:
            attrs["http.response.status_code"] = s.status
        if s.error is not None:
            attrs["error.type"] = s.error
        step = self.step_of(s)
        if step is not None:
            attrs["streamquake.step"] = step.name
            if step.kind:
                attrs["streamquake.step.kind"] = step.kind
            if step.faults:
                attrs["streamquake.faults"] = list(step.faults)
        attrs["streamquake.request.class"] = s.cls
        attrs["streamquake.request.attempt"] = s.attempt
        if s.retried:
            attrs["streamquake.request.retried"] = True
        if s.missing_events:
            attrs["streamquake.missing_events"] = s.missing_events
        if s.stalls:
            attrs["streamquake.stalls"] = s.stalls
        span = Span(
            trace_id=_id(s.trace_id, 16),
            span_id=_id(s.span_id, 8),
            name=f"{attrs['gen_ai.operation.name']} {self.model}".strip(),
            kind=Span.SPAN_KIND_CLIENT, start_time_unix_nano=start, end_time_unix_nano=end,
            attributes=_kvs(attrs))
        for at_ms, name in ((s.ttfb_ms, "streamquake.first_byte"),
                            (s.ttft_ms, "streamquake.first_token")):
            if at_ms is not None:
                span.events.add(time_unix_nano=start + _ms_ns(at_ms), name=name)
        for edge in self.edges:
            at = _ns(edge.at)
            if start <= at <= end:
                span.events.add(time_unix_nano=at, name=edge.name, attributes=_kvs(edge.attrs))
        if s.error is not None:
            detail = self.redact(s.error_detail)[:DETAIL_MAX] if (
                self.redact is not None and s.error_detail) else ""
            span.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR,
                                        message=f"{s.error}: {detail}" if detail else s.error))
        return span

    def traces(self, spans: list[Span]) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=self._resource(), scope_spans=[ScopeSpans(scope=self._scope(),
                                                               spans=spans)])])

    # -- metrics

    def measure(self, s: RequestSample) -> None:
        """Add a request to its step's histograms: the requests the report counts there."""
        step = self.step_of(s)
        if step is None or s.retried:
            return
        self.ends[step.name] = max(self.ends.get(step.name, step.end),
                                   s.sent + _end_ms(s) / 1000.0)
        key = (step.name, s.cls)
        self._hist(DURATION, *key, s.error or "").add(_end_ms(s) / 1000.0)
        if s.error is None and not s.cancelled:
            self._hist(TOKEN_USAGE, *key, "").add(float(s.output_tokens))
        if s.ttft_ms is not None:
            self._hist(TIME_TO_FIRST_CHUNK, *key, "").add(s.ttft_ms / 1000.0)
        if s.itl_ms:
            gaps = self._hist(TIME_PER_OUTPUT_CHUNK, *key, "")
            for gap in s.itl_ms:
                gaps.add(gap / 1000.0)

    def _hist(self, metric: str, step: str, cls: str, error: str) -> _Hist:
        key = (metric, step, cls, error)
        hist = self.hists.get(key)
        if hist is None:
            hist = self.hists[key] = _Hist(_METRICS[metric][2])
        return hist

    def metrics(self) -> ExportMetricsServiceRequest:
        metrics: list[Metric] = []
        for name, (description, unit, _bounds) in _METRICS.items():
            points = [self._point(name, step, cls, error, hist)
                      for (metric, step, cls, error), hist in self.hists.items()
                      if metric == name]
            if points:
                metrics.append(Metric(name=name, description=description, unit=unit,
                                      histogram=Histogram(
                                          data_points=points,
                                          aggregation_temporality=(
                                              AGGREGATION_TEMPORALITY_CUMULATIVE))))
        if not metrics:
            return ExportMetricsServiceRequest()
        return ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(
            resource=self._resource(),
            scope_metrics=[ScopeMetrics(scope=self._scope(), metrics=metrics)])])

    def _point(self, metric: str, step_name: str, cls: str, error: str,
               hist: _Hist) -> HistogramDataPoint:
        step = self.steps[step_name]
        attrs: dict[str, Attr] = dict(self.common)
        attrs["streamquake.step"] = step_name
        if step.kind:
            attrs["streamquake.step.kind"] = step.kind
        attrs["streamquake.request.class"] = cls
        if metric == TOKEN_USAGE:
            attrs["gen_ai.token.type"] = "output"
        if error:
            attrs["error.type"] = error
        return HistogramDataPoint(
            attributes=_kvs(attrs), start_time_unix_nano=_ns(step.start),
            time_unix_nano=_ns(self.ends.get(step_name, step.end)), count=hist.count,
            sum=hist.sum, bucket_counts=hist.counts, explicit_bounds=hist.bounds,
            min=hist.min, max=hist.max)

    def _resource(self) -> Resource:
        return Resource(attributes=_kvs({
            "service.name": "streamquake", "service.version": self.result.tool_version,
            "streamquake.scenario": self.result.scenario_name}))

    def _scope(self) -> InstrumentationScope:
        return InstrumentationScope(name="streamquake", version=self.result.tool_version)


def _edges(result: RunResult) -> list[_Edge]:
    """Every fault apply and revert (each switch of a flapping fault), as span events."""
    out: list[_Edge] = []
    for f in result.faults:
        attrs: dict[str, Attr] = {"streamquake.fault.name": f.name,
                                  "streamquake.fault.type": f.type}
        if f.settings:
            attrs["streamquake.fault.settings"] = f.settings
        if f.edges:
            out += [_Edge(e.at, "streamquake.fault.applied" if e.state == "on"
                          else "streamquake.fault.reverted", attrs) for e in f.edges]
            continue
        if f.applied_at is not None:
            out.append(_Edge(f.applied_at, "streamquake.fault.applied", attrs))
        if f.reverted_at is not None:
            out.append(_Edge(f.reverted_at, "streamquake.fault.reverted", attrs))
    return sorted(out, key=lambda e: e.at)


def _end_ms(s: RequestSample) -> float:
    """How long after ``sent`` the attempt ended: its E2E, or (never written by the client
    today, kept for old samples) the latest time it reached."""
    if s.e2e_ms is not None:
        return max(0.0, s.e2e_ms)
    return max((t for t in (s.ttfb_ms, s.ttft_ms) if t is not None), default=0.0)


def _ns(epoch_s: float) -> int:
    return round(epoch_s * 1e9)


def _ms_ns(ms: float) -> int:
    return round(ms * 1e6)


def _is_hex(text: str, n: int) -> bool:
    """``text`` is a valid W3C id of ``n`` bytes: lower-case hex, not all zeros."""
    return (len(text) == 2 * n and all(c in "0123456789abcdef" for c in text)
            and text.strip("0") != "")


def _id(text: str | None, n: int) -> bytes:
    """The sample's id, or (a sample without a valid one) a fresh random one."""
    return bytes.fromhex(text) if text is not None and _is_hex(text, n) else _random_id(n)


def _random_id(n: int) -> bytes:
    while True:                     # an all-zero id is invalid
        raw = os.urandom(n)
        if any(raw):
            return raw


def _kvs(attrs: dict[str, Attr]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_value(v)) for k, v in attrs.items()]


def _value(v: Attr) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, list):
        return AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=x) for x in v]))
    return AnyValue(string_value=v)


# -- the wire --------------------------------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a failure: traffic goes only to the URL the user gave."""

    def redirect_request(self, req: urllib.request.Request, fp: object, code: int, msg: str,
                         headers: object, newurl: str) -> None:
        return None


class _Sender:
    """POSTs to ``URL/v1/traces`` and ``URL/v1/metrics``; after a failure to reach the
    receiver at all (refused, timed out), sends nothing more."""

    def __init__(self, url: str, timeout_s: float, deadline: float) -> None:
        self.url, self.timeout_s, self.deadline = url, timeout_s, deadline
        self.problems: list[str] = []
        self.broken = False          # the receiver could not be reached: stop
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                   _NoRedirect())

    def traces(self, request: ExportTraceServiceRequest) -> bool:
        return self._post("/v1/traces", request, ExportTraceServiceResponse(), "spans")

    def metrics(self, request: ExportMetricsServiceRequest) -> bool:
        return self._post("/v1/metrics", request, ExportMetricsServiceResponse(),
                          "data points")

    def _post(self, path: str, body: Message, answer: Message, what: str) -> bool:
        if time.monotonic() > self.deadline:
            self.broken = True
            self._say(f"{path}: stopped after {DEADLINE_S:g} s")
            return False
        req = urllib.request.Request(self.url + path, data=body.SerializeToString(),
                                     method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                data = resp.read(1 << 20)
        except urllib.error.HTTPError as exc:
            self._say(f"{path}: HTTP {exc.code} {exc.reason}".rstrip() + _reason(exc))
            return False
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            self.broken = True
            self._say(f"{path}: {_words(why)}")
            return False
        return self._partial(path, data, answer, what)

    def _partial(self, path: str, data: bytes, answer: Message, what: str) -> bool:
        """A 2xx answer may still reject part of the request (OTLP's partial success)."""
        try:
            answer.ParseFromString(data)
        except DecodeError:
            return True                # not protobuf (a JSON "{}", an empty body): accepted
        partial = getattr(answer, "partial_success", None)
        rejected = int(getattr(partial, "rejected_spans", 0) or
                       getattr(partial, "rejected_data_points", 0) or 0)
        if rejected:
            message = str(getattr(partial, "error_message", "") or "")[:200]
            self._say(f"{path}: the receiver rejected {rejected} {what}"
                      + (f" ({message})" if message else ""))
            return False
        return True

    def _say(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)


def _reason(exc: urllib.error.HTTPError) -> str:
    """The receiver's own words, if short and printable (OTLP puts a google.rpc.Status or
    text in the body)."""
    try:
        body = exc.read(300)
    except OSError:
        return ""
    text = "".join(ch for ch in body.decode("utf-8", "replace") if ch.isprintable()).strip()
    return f" ({text[:200]})" if text else ""


def _words(why: object) -> str:
    if isinstance(why, TimeoutError) or "timed out" in str(why):
        return "no answer (timed out)"
    if isinstance(why, ConnectionRefusedError):
        return "connection refused (is a receiver listening there?)"
    if isinstance(why, OSError) and why.strerror:
        return why.strerror
    return str(why) or type(why).__name__

