"""What real OpenAI-compatible servers do that the embedded target does not, and what
streamquake must make of it (issue 19): streams cut short with their terminal event, usage that
counts more tokens than arrived, no usage at all, another model in the answer, FastAPI-style
and plain-text error bodies, a base URL that already ends in the API's prefix, and SLOs that
cannot be measured against such a server.

The servers are tests/hostile_server.py routes shaped like llama.cpp's two servers (see
shared notes "real-engines"); tests/test_real_engine.py runs the real llama-server.
"""

from __future__ import annotations

import json
import random
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.wire import join_path
from streamquake.run.scoring import score_samples
from streamquake.run.timeline import PhaseWindow
from streamquake.run.verdicts import check_slo
from streamquake.scenario import parse_scenario
from streamquake.scenario.schema import SLOSpec, VerdictSpec
from tests import one_request
from tests.conftest import REPO, listening, run_cli

KEY = "sk-" + "31415926535897932384626433832795"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from listening([sys.executable, str(REPO / "tests" / "hostile_server.py")],
                         "hostile server")


def measure(base_url: str, protocol: str, path: str | None = None,
            headers: dict[str, str] | None = None) -> RequestSample:
    return one_request.measure(base_url, protocol, path, cls=RequestClassPlan(), timeout_s=10.0,
                               model="gpt-4o", headers=headers, environ={"KEY": KEY})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("protocol", "path"), [("openai", "/openai-cut"),
                                                ("anthropic", "/anthropic-cut")])
def test_a_stream_whose_terminal_event_comes_without_a_finish_reason_is_truncated(
        server: str, protocol: str, path: str) -> None:
    s = measure(server, protocol, path)
    assert s.error == "truncated", (s.error, s.error_detail)
    assert "without a finish reason" in (s.error_detail or "")
    assert s.content_events >= 1 and s.ttft_ms is not None   # what it showed is still timed


@pytest.mark.timeout(30)
def test_a_base_url_with_the_api_prefix_reaches_the_api_and_reads_llama_servers_shape(
        server: str) -> None:
    # The form SDKs take: http://host:port/v1; the OpenAI path is /v1/chat/completions.
    s = measure(server + "/v1", "openai")
    assert s.error is None, s.error_detail
    assert (s.content_events, s.usage_tokens, s.output_tokens) == (8, 8, 8)
    assert (s.model, s.finish_reason, s.response_id) == ("tiny", "length", "chatcmpl-1")
    assert join_path("/v1", "/v1/chat/completions") == "/v1/chat/completions"
    assert join_path("/api/v1", "/v1/messages") == "/api/v1/messages"
    assert join_path("/gateway", "/v1/chat/completions") == "/gateway/v1/chat/completions"
    assert join_path("", "/v1beta/models/m:streamGenerateContent?alt=sse") == \
        "/v1beta/models/m:streamGenerateContent?alt=sse"


@pytest.mark.timeout(30)
def test_error_bodies_in_the_common_shapes_are_kept_and_redacted_before_they_are_cut(
        server: str) -> None:
    s = measure(server, "openai", "/fastapi-401",
                headers={"Authorization": "Bearer ${KEY}"})
    assert s.error == "http_status"
    detail = s.error_detail or ""
    assert detail.startswith("HTTP 401: xxx"), detail
    # The key sits 250 characters into the text: redacted whole, not cut in half first.
    assert KEY[3:11] not in detail and "[redacted]" not in detail[:200]
    assert len(detail) <= 300
    s = measure(server, "openai", "/plain-404")
    assert (s.error, s.error_detail) == ("http_status", "HTTP 404: File Not Found")


def _samples(server: str, path: str, n: int) -> list[RequestSample]:
    return [measure(server, "openai", path) for _ in range(n)]


SCENARIO = """
name: usage
target: {protocol: openai, url: "http://127.0.0.1:1", model: gpt-4o}
load: {users: 1, classes: [{name: chat, prompt: hi, max_tokens: 8}]}
phases: {warmup: 0s, baseline: 100s, fault: 0s, recovery: 0s}
"""


@pytest.mark.timeout(60)
def test_usage_against_events_tokens_without_usage_and_another_model_are_counted_and_said(
        server: str) -> None:
    short = _samples(server, "/openai-short", 3)
    counted = _samples(server, "/openai-no-usage", 2)
    assert all(s.error is None for s in short + counted)
    stats = Stats.from_samples(short + counted)
    assert (stats.usage_tokens, stats.usage_unseen, stats.usage_short) == (24, 6, 3)
    assert stats.value("usage_deficit") == pytest.approx(0.25)
    low, high, n = stats.rate_interval("usage_deficit", 0.95)
    assert n == 24 and low is not None and high is not None and low < 0.25 < high
    assert stats.tokens_counted == 2
    assert [s.output_tokens for s in counted] == [5, 5]
    assert stats.answered_models == {"tiny": 5}

    start = min(s.started for s in short + counted) - 1
    windows = [PhaseWindow("baseline", start, start + 100)]
    warnings = score_samples(parse_scenario(SCENARIO), windows, short + counted).warnings
    text = "\n".join(warnings)
    assert "3 of 5 successful streams brought fewer content events than their usage" in text
    assert "6 of 24 tokens, 25.0%" in text
    assert "2 of 5 successful requests came without the server's usage" in text
    assert "'tiny' (5)" in text and "'gpt-4o'" in text


def test_an_slo_that_cannot_be_measured_warns_by_default_and_one_without_data_still_fails(
) -> None:
    ok = RequestSample(cls="c", sent=time.time(), ttft_ms=5.0, e2e_ms=9.0, content_events=3)
    no_ids = Stats.from_samples([ok])
    slo = SLOSpec(metric="chunk_loss", max=0.01)
    check = check_slo(slo, "baseline", no_ids)
    assert (check.measurable, check.passed, check.observed) == (False, True, None)
    assert check.detail.startswith("not measurable: the server numbers none of its events")
    assert not check_slo(slo, "baseline", no_ids,
                         verdicts=VerdictSpec(unmeasurable="fail")).passed
    # Every request failed: nothing measured TTFT, and that is a broken service, not
    # an unmeasurable metric.
    failed = RequestSample(cls="c", sent=time.time(), error="http_status",
                           error_detail="HTTP 404")
    check = check_slo(SLOSpec(metric="ttft_ms", percentile=95, max=100), "baseline",
                      Stats.from_samples([failed]))
    assert (check.measurable, check.passed) == (True, False)


RUN = """
name: no-ids
target:
  protocol: openai
  embedded:
    ttft: {{dist: fixed, value: 20ms}}
    itl: {{dist: fixed, value: 5ms}}
    output_tokens: {{min: 10, max: 10}}
    seed: 1
  timeout: 10s
load:
  users: 2
  think_time: {{min: 20ms, max: 50ms}}
  classes: [{{name: chat, prompt: hi, max_tokens: 10}}]
phases: {{warmup: 4s, baseline: 3s, fault: 0s, recovery: 0s}}
slos:
  - {{metric: chunk_loss, max: 1%, phases: [baseline]}}
  - {{metric: error_rate, max: 1%, phases: [baseline]}}
{verdicts}
"""


@pytest.mark.timeout(180)
def test_a_run_with_an_unmeasurable_slo_exits_0_and_says_why_in_every_output(
        tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(RUN.format(verdicts=""))
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not measurable" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    loss = [c for c in report["checks"] if c["metric"] == "chunk_loss"]
    assert loss and all(c["measurable"] is False and c["passed"] for c in loss)
    assert "not measurable" in (out / "summary.md").read_text()
    cases = ET.parse(out / "junit.xml").getroot().iter("testcase")
    skipped = [c for c in cases if "chunk_loss" in c.get("name", "")]
    assert skipped and all(c.find("skipped") is not None for c in skipped)
    # ... and gated as failed when the scenario says so.
    scenario.write_text(RUN.format(verdicts="verdicts: {unmeasurable: fail}"))
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out2"), timeout=150)
    assert proc.returncode == 1, proc.stdout + proc.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["no-choices", "null-choices", "list-delta"])
def test_events_of_the_wrong_shape_are_protocol_errors(server: str, kind: str) -> None:
    s = measure(server, "openai", f"/wrong-shape?kind={kind}")
    assert s.error == "protocol", (kind, s.error, s.error_detail)
    assert "choice" in (s.error_detail or "")


SECRET = "sk-QZ" + "x7Wq9Lp2Vn4Rt6Yb8Mc3Kd5Jf1Hg0Sa"
HOWS = ("json", "detail", "plain", "redirect", "retry", "ctype", "event", "not-json", "id")


@pytest.mark.timeout(300)
def test_a_key_at_any_offset_in_anything_a_target_says_is_redacted_whole(server: str) -> None:
    """The key from 0 to 400 characters into each kind of text a target can send back: no
    six characters of it in what a sample keeps (reason, response id, model, finish)."""
    pieces = {SECRET[i:i + 6] for i in range(len(SECRET) - 5)}
    plan = LoadPlan.model_validate({
        "base_url": server, "protocol": "openai", "samples_path": "/nonexistent", "end_at": 0.0,
        "timeout_s": 10.0, "connect_timeout_s": 5.0, "headers": {"Authorization": "Bearer ${K}"}})
    leaks: list[tuple[str, int, str]] = []
    seen = 0
    for how in HOWS:
        client = StreamClient(plan.model_copy(update={"path": f"/echo-key-at?how={how}"}),
                              environ={"K": SECRET})
        try:
            for offset in range(401):
                client._path = f"/echo-key-at?how={how}&offset={offset}"
                s = client.measure(RequestClassPlan(), random.Random(0))
                kept = " ".join(t for t in (s.error_detail, s.response_id, s.model,
                                            s.finish_reason) if t)
                seen += "[redacted]" in kept
                if any(p in kept for p in pieces):
                    leaks.append((how, offset, kept))
        finally:
            client.close()
    assert not leaks, leaks[:3]
    assert seen > 400          # the key was there to redact, in every way, where it was kept
