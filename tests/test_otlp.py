"""``run --otlp URL``: a real run (the CLI, the embedded target, the SSE proxy's fault) sends its
requests as spans and its per-step GenAI client metrics to an OTLP/HTTP receiver on loopback,
which decodes what arrives with opentelemetry-proto; what it decodes is compared with the run's
own samples and report.json. A receiver that fails (HTTP 500, nobody listening, no answer) is a
warning, and the run's exit code and verdicts stay what they were."""

from __future__ import annotations

import csv
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from streamquake.errors import EXIT_NOT_JUDGED
from tests.conftest import free_port, run_cli

SECRET = "sk-otlp-test-0123456789abcdef"

SCENARIO = """
name: otlp
target:
  protocol: openai
  model: sim-1
  headers: {Authorization: "Bearer ${STREAMQUAKE_OTLP_TEST_KEY}"}
  embedded:
    ttft: {dist: lognormal, median: 60ms, sigma: 0.1}
    itl: {dist: normal, mean: 10ms, stddev: 1ms}
    output_tokens: {min: 10, max: 20}
    sse_event_ids: true
    seed: 3
  timeout: 10s
load:
  users: 3
  think_time: {min: 50ms, max: 100ms}
  classes:
    - {name: chat, weight: 3, prompt: "Explain SSE.", max_tokens: 20}
    - {name: short, weight: 1, prompt: "Say hi.", max_tokens: 10}
  seed: 3
phases: {warmup: 1s, baseline: 3s, fault: 3s, recovery: 3s}
faults:
  - {type: sse_proxy, name: chunk-drop, phase: fault, drop: 20%, first_event_delay: 100ms,
     abort: {status: 503, probability: 30%}, seed: 3}
slos:
  - {metric: error_rate, max: 50%, phases: [baseline, recovery]}
  - {metric: ttft_ms, percentile: 95, max: 5000, phases: [baseline, recovery]}
"""

NS = 1_000_000_000
US = 1_000          # one microsecond in nanoseconds


# -- a receiver on loopback --------------------------------------------------------------------


@dataclass
class Receiver:
    url: str
    status: int = 200
    bodies: list[tuple[str, bytes]] = field(default_factory=list)

    def traces(self) -> list[ExportTraceServiceRequest]:
        return [ExportTraceServiceRequest.FromString(b) for p, b in self.bodies
                if p == "/v1/traces"]

    def metrics(self) -> list[ExportMetricsServiceRequest]:
        return [ExportMetricsServiceRequest.FromString(b) for p, b in self.bodies
                if p == "/v1/metrics"]

    def spans(self) -> list[Span]:
        return [span for req in self.traces() for rs in req.resource_spans
                for ss in rs.scope_spans for span in ss.spans]


@pytest.fixture(scope="module")
def receiver_factory() -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(status: int = 200) -> Receiver:
        rec = Receiver("", status)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                rec.bodies.append((self.path, body))
                answer = (ExportTraceServiceResponse() if self.path == "/v1/traces"
                          else ExportMetricsServiceResponse()).SerializeToString()
                if rec.status != 200:
                    answer = b"receiver says no"
                self.send_response(rec.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        rec.url = f"http://127.0.0.1:{server.server_address[1]}"
        return rec

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@dataclass
class Run:
    out: Path
    proc: Any
    receiver: Receiver

    @property
    def report(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.out / "report.json").read_text())
        return data

    def samples(self) -> list[dict[str, Any]]:
        """Every sample of this run, as the load processes wrote them (full float precision)."""
        since = self.report["started_at"]
        out = []
        for path in sorted((self.out / "run" / "samples").glob("samples-*.jsonl")):
            for line in path.read_text().splitlines():
                s = json.loads(line)
                if s["sent"] >= since:
                    out.append(s)
        return out

    def phase_of(self) -> dict[str, str]:
        """trace id -> the step samples.csv counts the request in ('' for none)."""
        with open(self.out / "samples.csv", newline="") as f:
            return {row["trace_id"]: row["phase"] for row in csv.DictReader(f)}


def _run(tmp: Path, receiver: Receiver, url: str | None = None) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    scenario = tmp / "otlp.yaml"
    scenario.write_text(SCENARIO)
    out = tmp / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), "--otlp", url or receiver.url,
                   env={"STREAMQUAKE_STATE_DIR": str(tmp / "state"),
                        "STREAMQUAKE_OTLP_TEST_KEY": SECRET}, timeout=150)
    return Run(out, proc, receiver)


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory, receiver_factory: Any) -> Run:
    return _run(tmp_path_factory.mktemp("otlp-ok"), receiver_factory())


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory, receiver_factory: Any) -> Run:
    return _run(tmp_path_factory.mktemp("otlp-500"), receiver_factory(500))


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _plain(kv.value) for kv in kvs}


def _plain(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_plain(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_each_request_is_a_span_in_its_own_trace_at_its_own_times(sent: Run) -> None:
    # 0, or 6 where a busy machine saturated the load generator in a step: spans either way.
    assert sent.proc.returncode in (0, EXIT_NOT_JUDGED), sent.proc.stdout + sent.proc.stderr
    report, samples, phase_of = sent.report, sent.samples(), sent.phase_of()
    spans = sent.receiver.spans()
    assert f"sent {len(samples)} spans" in sent.proc.stdout, sent.proc.stdout
    assert len(spans) == len(samples) == len(phase_of) > 40
    by_trace = {s["trace_id"]: s for s in samples}
    assert len(by_trace) == len(samples)                 # one trace per attempt
    assert {span.trace_id.hex() for span in spans} == set(by_trace)

    target_port = int(report["target"]["url"].rsplit(":", 1)[1])
    faults = {f["name"]: f for f in report["faults"]}
    applied, reverted = (faults["chunk-drop"]["applied_at"], faults["chunk-drop"]["reverted_at"])
    failed_in_fault = 0
    for span in spans:
        s = by_trace[span.trace_id.hex()]
        a = _attrs(span.attributes)
        start, end = s["sent"] * NS, (s["sent"] + s["e2e_ms"] / 1000) * NS
        assert abs(span.start_time_unix_nano - start) <= US, (span.start_time_unix_nano, start)
        assert abs(span.end_time_unix_nano - end) <= US, (span.end_time_unix_nano, end)
        # The traceparent's own span id: a server's spans name this span as their parent.
        assert span.span_id.hex() == s["span_id"] and len(span.span_id) == 8
        assert span.parent_span_id == b""               # the client's span is the root
        assert span.kind == Span.SPAN_KIND_CLIENT and span.name == "chat sim-1"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == "sim-1"
        assert (a["server.address"], a["server.port"]) == ("127.0.0.1", target_port)
        assert a["streamquake.request.class"] == s["cls"]
        assert a.get("streamquake.step", "") == phase_of[s["trace_id"]]
        if a.get("streamquake.step") == "fault":
            assert a["streamquake.faults"] == ["chunk-drop"]
        else:
            assert "streamquake.faults" not in a, a
        if s["error"] is not None:
            assert a["error.type"] == s["error"]
            assert span.status.code == Status.STATUS_CODE_ERROR
            assert span.status.message.startswith(s["error"])
            failed_in_fault += a.get("streamquake.step") == "fault"
        else:
            assert "error.type" not in a and span.status.code == Status.STATUS_CODE_UNSET
            assert a["gen_ai.usage.output_tokens"] == s["output_tokens"]
            assert a["gen_ai.response.model"] == s["model"]
        events = {e.name: e.time_unix_nano for e in span.events}
        if s["ttft_ms"] is not None:
            ttft = (s["sent"] + s["ttft_ms"] / 1000) * NS
            assert abs(events["streamquake.first_token"] - ttft) <= US
        else:
            assert "streamquake.first_token" not in events
        for name, at in (("streamquake.fault.applied", applied),
                         ("streamquake.fault.reverted", reverted)):
            if span.start_time_unix_nano <= round(at * NS) <= span.end_time_unix_nano:
                assert abs(events[name] - at * NS) <= US, (name, events)
            else:
                assert name not in events, (name, events)
    assert failed_in_fault > 0          # the fault's aborts are there to be seen
    in_flight = [span for span in spans
                 if any(e.name.startswith("streamquake.fault.") for e in span.events)]
    assert in_flight, "no request was in flight at a fault edge"


@pytest.mark.timeout(200)
def test_per_step_histograms_count_the_requests_the_report_counts(sent: Run) -> None:
    report, samples = sent.report, sent.samples()
    points: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for req in sent.receiver.metrics():
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    assert m.WhichOneof("data") == "histogram", m.name
                    points.setdefault(m.name, []).extend(
                        (_attrs(p.attributes), p) for p in m.histogram.data_points)
    assert set(points) == {"gen_ai.client.operation.duration", "gen_ai.client.token.usage",
                           "gen_ai.client.operation.time_to_first_chunk",
                           "gen_ai.client.operation.time_per_output_chunk"}
    for _name, pts in points.items():
        for a, p in pts:
            assert sum(p.bucket_counts) == p.count and len(p.bucket_counts) == len(
                p.explicit_bounds) + 1
            assert a["gen_ai.operation.name"] == "chat" and "streamquake.step" in a

    def count(metric: str, step: str, **match: Any) -> int:
        return sum(p.count for a, p in points[metric] if a["streamquake.step"] == step
                   and all(a.get(k) == v for k, v in match.items()))

    phase_of = sent.phase_of()
    for phase in report["phases"]:
        name, stats = phase["name"], phase["stats"]
        mine = [s for s in samples if phase_of[s["trace_id"]] == name and not s["retried"]]
        assert count("gen_ai.client.operation.duration", name) == stats["requests"] == len(
            mine) > 0, name
        assert count("gen_ai.client.token.usage", name,
                     **{"gen_ai.token.type": "output"}) == stats["successes"]
        assert count("gen_ai.client.operation.time_to_first_chunk", name) == sum(
            s["ttft_ms"] is not None for s in mine)
        assert count("gen_ai.client.operation.time_per_output_chunk", name) == sum(
            len(s["itl_ms"]) for s in mine)
        errors = sum(p.count for a, p in points["gen_ai.client.operation.duration"]
                     if a["streamquake.step"] == name and "error.type" in a)
        assert errors == stats["requests"] - stats["successes"]
    assert sum(p.count for a, p in points["gen_ai.client.operation.duration"]
               if a["streamquake.step"] == "fault" and "error.type" in a) > 0


@pytest.mark.timeout(200)
def test_no_credential_leaves_for_the_receiver(sent: Run) -> None:
    assert sent.receiver.bodies
    for _path, body in sent.receiver.bodies:
        assert SECRET.encode() not in body and b"Explain SSE" not in body


@pytest.mark.timeout(200)
def test_a_receiver_answering_500_is_a_warning_and_changes_no_verdict(sent: Run,
                                                                       refused: Run) -> None:
    proc = refused.proc
    assert refused.receiver.bodies                       # it was asked, and said no
    # The exit code is the verdict's: 0, or 6 where a busy machine saturated the load generator
    # in a step (under scripts/test-stress one of the two runs ended 6, the other 0): never the
    # export's failure.
    report = refused.report
    assert proc.returncode == report["exit_code"] in (0, EXIT_NOT_JUDGED), \
        proc.stdout + proc.stderr
    assert sent.proc.returncode in (0, EXIT_NOT_JUDGED)
    assert "Traceback" not in proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert f"warning: OTLP export to {refused.receiver.url} failed: /v1/traces: HTTP 500" in said
    assert all(c["passed"] or c["not_judged"] for c in report["checks"]), report["checks"]
    assert [(c["name"], c["phase"]) for c in report["checks"]] == [
        (c["name"], c["phase"]) for c in sent.report["checks"]]
    warning = next(e for e in report["errors"] if e.startswith("OTLP export"))
    assert "HTTP 500" in warning and "receiver says no" in warning
    assert "OTLP export to" in (refused.out / "summary.md").read_text()
    assert "OTLP export" not in " ".join(sent.report["errors"])


def _result_of(run: Run) -> Any:
    """The finished run as export_run takes it, rebuilt from its report.json."""
    from streamquake.result import FaultRecord, PhaseResult, RunResult

    r = run.report
    phases = [PhaseResult(p["name"], p["start"], p["end"], p["stats"], kind=p["kind"],
                          faults=p["faults"]) for p in r["phases"]]
    faults = [FaultRecord(f["name"], f["type"], f["phase"], f["configured"],
                          applied_at=f["applied_at"], reverted_at=f["reverted_at"])
              for f in r["faults"]]
    return RunResult(r["scenario_name"], r["scenario_file"], r["scenario_echo"],
                     r["tool_version"], r["started_at"], r["finished_at"], None, phases, [],
                     faults, r["target"])


@pytest.mark.timeout(60)
def test_nobody_listening_or_no_answer_is_one_sentence_each(sent: Run) -> None:
    from streamquake.reports.otlp import export_run

    result = _result_of(sent)
    closed = f"http://127.0.0.1:{free_port()}"
    got = export_run(result, sent.out / "run" / "samples", closed)
    assert (got.spans, got.points) == (0, 0) and got.requests == len(sent.samples())
    assert got.problems == [f"OTLP export to {closed} failed: /v1/traces: connection refused "
                            f"(is a receiver listening there?); sent 0 of {got.requests} spans "
                            "and 0 metric points (the verdict and the reports do not depend "
                            "on it)"]
    with socket.socket() as silent:                     # accepts (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        got = export_run(result, sent.out / "run" / "samples", url, timeout_s=1.0)
    assert len(got.problems) == 1 and "/v1/traces: no answer (timed out)" in got.problems[0]
    assert (got.spans, got.points) == (0, 0)


@pytest.mark.timeout(60)
def test_a_bad_otlp_url_is_a_usage_error(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    for url, words in (("ftp://127.0.0.1:4318", "--otlp ftp://127.0.0.1:4318: give an OTLP"),
                       ("http://user:pw@127.0.0.1:4318", "holds credentials")):
        proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), "--otlp", url,
                       env={"STREAMQUAKE_OTLP_TEST_KEY": SECRET})
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert words in " ".join(proc.stderr.split()), proc.stderr
        assert "pw@" not in proc.stderr + proc.stdout
        assert not (tmp_path / "out").exists()

