"""Every stream read as its server sends it (issue 31), and a run that read no text is a protocol
mismatch, never a pass (issue 30).

Real servers on loopback: ``tests/format_servers.py`` sends the exact bytes of ``transformers
serve`` (no ``[DONE]``) and the Responses API's error endings; the embedded target speaks legacy
completions, the Responses API and llama.cpp's native ``/completion``; ``llama-server`` (when
``scripts/build-llama-server`` has built it; CI does) speaks ``/v1/completions``,
``/v1/responses`` and ``/completion`` itself.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake import protocols
from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.sse_parser import SSEEvent
from streamquake.result import Check
from streamquake.scenario import parse_scenario
from tests import format_servers
from tests.conftest import run_cli
from tests.engines.llama_server import BUILD, ENV_BINARY, EXACT_LENGTH, LlamaServer, serve
from tests.engines.tap import Tap
from tests.helpers import assert_run_ok
from tests.one_request import measure
from tests.timing import HANG_S

FAST = {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 12, "max": 12}, "seed": 3}


@pytest.fixture(scope="module")
def wire() -> Iterator[str]:
    with format_servers.serve() as url:
        yield url


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    with start_target(TargetConfig.model_validate(FAST)) as t:
        yield t


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama-server with the tiny model; skipped (with the way to build it) where it is not
    built: CI builds it first, so there these tests run."""
    if not os.environ.get(ENV_BINARY):
        done = subprocess.run([str(BUILD), "--cached"], capture_output=True, text=True,
                              timeout=HANG_S)
        if done.returncode != 0:
            pytest.skip(f"llama-server is not built here ({done.stderr.strip()}); "
                        "scripts/build-llama-server builds it (CI does, before the tests)")
    yield from serve(tmp_path_factory.mktemp("llama-server"), slots=2)


def ok(s: RequestSample) -> RequestSample:
    assert s.error is None, (s.error, s.error_detail)
    return s


# --- OpenAI chat with no [DONE]: transformers serve --------------------------------------------


@pytest.mark.timeout(30)
def test_a_stream_that_ends_cleanly_after_its_finish_reason_is_complete_without_done(
        wire: str) -> None:
    s = ok(measure(wire, "openai", cls=RequestClassPlan(prompts=["hi"], max_tokens=32)))
    assert (s.content_events, s.usage_tokens, s.output_tokens) == (32, 32, 32)
    assert s.finish_reason == "length" and s.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert s.ttft_ms is not None and len(s.itl_ms) == 31
    assert s.e2e_ms is not None and s.e2e_ms >= s.ttft_ms


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("case", "says"), [
    ("no-finish", "the stream ended before the protocol's final event"),
    ("cut", "the stream broke off"),
])
def test_without_a_finish_reason_or_a_clean_end_it_is_still_truncated(
        wire: str, case: str, says: str) -> None:
    s = measure(wire, "openai", f"/v1/chat/completions?case={case}")
    assert s.error == "truncated", (s.error, s.error_detail)
    assert says in (s.error_detail or "")
    assert s.content_events == 8           # what came is still timed


SCENARIO = """
name: {name}
target:
  protocol: {protocol}
  url: "{url}"
  {path}
  probe: {probe}
  timeout: 20s
load:
  users: 2
  think_time: {{min: 10ms, max: 40ms}}
  classes: [{cls}]
phases: {{warmup: 0s, baseline: 3s, fault: 0s, recovery: 0s}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 10s, phases: [baseline]}}
  - {{metric: error_rate, max: 1%}}
"""


def _scenario(tmp_path: Path, *, url: str, protocol: str = "openai", path: str | None = None,
              cls: str = "{name: chat, prompt: hi, max_tokens: 8}", probe: bool = True,
              slos: str | None = None) -> Path:
    text = SCENARIO.format(name="formats", protocol=protocol, url=url,
                           path=f"path: {path}" if path else "", probe=str(probe).lower(),
                           cls=cls)
    if slos is not None:
        text = text.split("slos:")[0] + slos
    scenario = tmp_path / "s.yaml"
    scenario.write_text(text)
    return scenario


def _run(tmp_path: Path, scenario: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    return run_cli("run", str(scenario), "--out", str(out), timeout=240), out


def _baseline(out: Path) -> dict[str, Any]:
    report = json.loads((out / "report.json").read_text())
    (phase,) = [p for p in report["phases"] if p["name"] == "baseline"]
    stats: dict[str, Any] = phase["stats"]
    return stats


@pytest.mark.timeout(300)
def test_a_run_against_transformers_serve_reads_every_stream_complete(
        tmp_path: Path, wire: str) -> None:
    proc, out = _run(tmp_path, _scenario(tmp_path, url=wire,
                                         cls="{name: chat, prompt: hi, max_tokens: 32}"))
    assert_run_ok(proc, out)
    stats = _baseline(out)
    assert stats["requests"] >= 3 and stats["successes"] == stats["requests"], stats
    assert sum(stats["errors"].values()) == 0, stats["errors"]
    # usage (32 per stream) = the content events that arrived: none lost, none unseen.
    assert stats["usage_tokens"] == 32 * stats["successes"] and stats["usage_unseen"] == 0
    assert stats["ttft_ms"]["count"] == stats["successes"]


# --- legacy completions, under protocol: openai -------------------------------------------------


@pytest.mark.timeout(30)
def test_legacy_completions_are_read_as_content_against_the_embedded_target(
        target: TargetProcess) -> None:
    # The request is the endpoint's own ({"prompt"}, not "messages"): the target accepts it.
    s = ok(measure(target.url, "openai", "/v1/completions"))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (8, 8, "length")
    assert s.ttft_ms is not None and len(s.itl_ms) == 7
    assert (s.response_id or "").startswith("cmpl-")
    s = ok(measure(target.url, "openai", "/v1/completions",
                   cls=RequestClassPlan(prompts=["hi"], max_tokens=50)))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (12, 12, "stop")


# --- the Responses API ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_responses_api_against_the_embedded_target(target: TargetProcess) -> None:
    s = ok(measure(target.url, "openai_responses",
                   cls=RequestClassPlan(prompts=["hi"], max_tokens=50)))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (12, 12, "completed")
    assert s.ttft_ms is not None and (s.response_id or "").startswith("resp_")
    assert s.model == "m-1"
    # Cut by max_output_tokens: response.incomplete, an answer all the same.
    s = ok(measure(target.url, "openai_responses"))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (8, 8, "max_output_tokens")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("case", "error", "says"), [
    ("failed", "stream_error", "server_error: The model crashed mid-answer"),
    ("error", "stream_error", "rate_limit_exceeded: Slow down, please"),
    ("filtered", None, None),
    ("cut", "truncated", "the stream ended before the protocol's final event"),
])
def test_the_responses_api_endings_map_to_outcomes(wire: str, case: str, error: str | None,
                                                     says: str | None) -> None:
    s = measure(wire, "openai_responses", f"/v1/responses?case={case}")
    assert (s.error, s.content_events) == (error, 2), s.error_detail
    assert s.ttft_ms is not None
    if says is not None:
        assert says in (s.error_detail or ""), s.error_detail
    if case == "filtered":
        assert (s.finish_reason, s.usage_tokens) == ("content_filter", 2)
    assert s.response_id == "resp_67ccd2bed1ec8190b14f964abc054267"


@pytest.mark.timeout(300)
def test_the_proxy_drops_responses_text_deltas_and_never_the_events_that_end_a_response(
        tmp_path: Path) -> None:
    """The shipped scenario, shortened: the SSE proxy drops 10% of the content events it sees
    without being told the format (sniffing), so every stream still ends (no error) and the
    lost deltas show as chunk loss in the fault phase only."""
    out = tmp_path / "out"
    proc = run_cli("run", "scenarios/openai-responses.yaml", "--out", str(out),
                   "--set", "phases.warmup=0s", "--set", "phases.baseline=3s",
                   "--set", "phases.fault=4s", "--set", "phases.recovery=3s", timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1, 6), text          # 6: a busy machine's timings unjudged
    report = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p["stats"] for p in report["phases"]}
    for name, stats in phases.items():
        assert sum(stats["errors"].values()) == 0, (name, stats["errors"])
        assert stats["successes"] == stats["requests"] > 0, name
    (fault,) = report["faults"]
    dropped = fault["reverted"]["stats"]["events_dropped"]
    assert dropped > 0 and phases["fault"]["chunk_loss"] > 0
    # Every delta the proxy dropped is one the usage counted and the client never saw.
    unseen = sum(stats["usage_unseen"] for stats in phases.values())
    assert unseen == dropped, (unseen, dropped)


# --- llama.cpp's native /completion -------------------------------------------------------------


@pytest.mark.timeout(30)
def test_llama_cpps_native_stream_against_the_embedded_target(target: TargetProcess) -> None:
    s = ok(measure(target.url, "llama_cpp"))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (8, 8, "limit")
    assert s.ttft_ms is not None and len(s.itl_ms) == 7


@pytest.mark.timeout(120)
def test_llama_server_native_legacy_and_responses_streams(engine: LlamaServer) -> None:
    native = RequestClassPlan(body={"prompt": "Tell me a story", "n_predict": 16,
                                    **EXACT_LENGTH})
    s = ok(measure(engine.url, "llama_cpp", cls=native))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (16, 16, "limit")
    assert s.ttft_ms is not None and len(s.itl_ms) == 15 and s.model
    legacy = RequestClassPlan(body={"prompt": "Tell me a story", "max_tokens": 16,
                                    **EXACT_LENGTH})
    s = ok(measure(engine.url, "openai", "/v1/completions", cls=legacy))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (16, 16, "length")
    assert s.ttft_ms is not None and len(s.itl_ms) == 15
    # Without a body of its own, the class's prompt goes in the endpoint's own request.
    s = ok(measure(engine.url, "openai", "/v1/completions"))
    assert s.content_events >= 1 and s.usage_tokens is not None
    # llama-server's /v1/responses: typed events, response.completed with usage, no [DONE].
    responses = RequestClassPlan(body={"input": "Tell me a story", "max_output_tokens": 16,
                                       **EXACT_LENGTH})
    s = ok(measure(engine.url, "openai_responses", cls=responses))
    assert (s.content_events, s.usage_tokens, s.finish_reason) == (16, 16, "completed")
    assert s.ttft_ms is not None and len(s.itl_ms) == 15
    assert (s.response_id or "").startswith("resp_") and s.model == engine.alias


# --- a protocol mismatch ----------------------------------------------------------------------

NATIVE_BODY = "{name: chat, body: {prompt: hi, n_predict: 8, ignore_eos: true}}"


@pytest.mark.timeout(300)
def test_the_probe_says_which_format_was_expected_and_which_reads_the_events(
        tmp_path: Path, target: TargetProcess) -> None:
    # The native llama.cpp stream, read as openai: not one chunk of it is OpenAI's.
    proc, _ = _run(tmp_path, _scenario(tmp_path, url=target.url, path="/completion",
                                       cls=NATIVE_BODY))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text
    assert "the probe before the load: class chat" in text
    assert "its events looked like: event 1 of 9: {\"index\": number, \"content\": string" in text
    assert "they read as `llama_cpp`: set target.protocol: llama_cpp" in text, text


def _samples(out: Path) -> list[RequestSample]:
    return [RequestSample.from_dict(json.loads(line))
            for f in sorted((out / "run" / "samples").glob("samples-*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


def _mismatch(scenario: Path, out: Path) -> tuple[list[Check], list[str], list[Check]]:
    """``mismatch_checks`` on the run's own checks and its baseline's stats (every sample of
    these runs is the baseline's: the other phases are 0 s long)."""
    from streamquake.run.mismatch import mismatch_checks

    report = json.loads((out / "report.json").read_text())
    checks = [Check(**c) for c in report["checks"]]
    stats = Stats.from_samples(_samples(out))
    turned, said = mismatch_checks(parse_scenario(scenario.read_text()), {"baseline": stats},
                                   checks)
    return turned, said, checks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["embedded", "llama-server"])
def test_a_run_that_read_no_text_fails_as_a_protocol_mismatch(
        tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    url = (request.getfixturevalue("target").url if where == "embedded"
           else request.getfixturevalue("engine").url)
    scenario = _scenario(tmp_path, url=url, path="/completion", cls=NATIVE_BODY, probe=False)
    proc, out = _run(tmp_path, scenario)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The run itself turned its checks (run/runner.py), and says why in its warnings.
    report = json.loads((out / "report.json").read_text())
    (ran,) = [c for c in report["checks"] if c["metric"] == "ttft_ms"]
    assert not ran["passed"] and ran["detail"].startswith("protocol mismatch")
    assert ran["detail"] in report["errors"]
    assert "protocol mismatch" in proc.stdout
    turned, said, before = _mismatch(scenario, out)
    (ttft,) = [c for c in turned if c.metric == "ttft_ms"]
    assert not ttft.passed and ttft.gating and ttft.observed is None
    assert ttft.detail == said[0]
    # The same sentence (the counts are the run's measured phases', here all the samples').
    assert ran["detail"].split(" in baseline")[0] == said[0].split(" in baseline")[0]
    assert said[0].startswith("protocol mismatch: not one event of this run read as generated "
                              "text")
    assert "`openai` at /completion reads text from chat chunks' choices[].delta.content" in said[0]
    # What the events looked like: the protocol errors quote them.
    assert "requests got events it could not parse (a chunk whose `choices` is null or " \
           "missing, not a list: '{\"index\":0,\"content\":" in said[0], said[0]
    assert len(turned) == len(before)          # the error_rate check broke on its own


@pytest.mark.timeout(300)
def test_a_run_whose_streams_all_succeed_without_text_fails_as_a_protocol_mismatch(
        tmp_path: Path, target: TargetProcess) -> None:
    # OpenAI chat read as generic SSE: every stream ends at [DONE], a "success" with no text;
    # an error_rate SLO alone passed it (ALL SLOs MET, exit 0); now the run fails, exit 1.
    body = ("{name: chat, body: {model: sim-1, messages: [{role: user, content: hi}], "
            "max_tokens: 8, stream: true}}")
    scenario = _scenario(tmp_path, url=target.url, protocol="sse", path="/v1/chat/completions",
                         cls=body, probe=False, slos="slos: [{metric: error_rate, max: 1%}]\n")
    from streamquake.run.mismatch import CHECK_NAME, mismatch_checks

    proc, out = _run(tmp_path, scenario)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    added = [c for c in report["checks"] if c["name"] == CHECK_NAME]
    assert [(c["passed"], c["gating"], c["observed"]) for c in added] == [(False, True, 0.0)]
    assert all(c["passed"] for c in report["checks"] if c["name"] != CHECK_NAME)
    assert "SLO BROKEN" in proc.stdout
    turned, said, before = _mismatch(scenario, out)
    assert said[0].split(" in baseline")[0] == added[0]["detail"].split(" in baseline")[0]
    assert "`sse` at /v1/chat/completions reads" in said[0]
    assert "streams ended as the format ends one with not one event of text" in said[0]
    # A run that read text is left alone.
    text = RequestSample(cls="chat", sent=0.0, ttft_ms=5.0, e2e_ms=9.0, content_events=3)
    assert mismatch_checks(parse_scenario(scenario.read_text()),
                           {"baseline": Stats.from_samples([*_samples(out), text])},
                           before) == (before, [])


# --- against the wire ---------------------------------------------------------------------------

WIRE_N, WIRE_T = 12, 32
PROMPT = "Tell me a story"


def against_the_wire(port: int, protocol: str, path: str | None,
                     body: dict[str, Any] | None, what: str) -> None:
    """``WIRE_N`` requests one after another, each on its own connection through a tap that
    reads the bytes itself (tests/engines/tap.py): every request's content events = the wire's
    = its usage, and the ITL gaps add up to the wire's first-to-last span within 3%."""
    wire = protocols.get(protocol)
    with Tap(port) as tap:
        fields: dict[str, object] = {"base_url": tap.url, "protocol": protocol,
                                     "samples_path": "/nonexistent", "end_at": 0.0,
                                     "timeout_s": 30.0}
        if path is not None:
            fields["path"] = path
        cls = RequestClassPlan(body=body) if body else RequestClassPlan(prompts=[PROMPT],
                                                                       max_tokens=WIRE_T)
        samples = []
        for i in range(WIRE_N):
            client = StreamClient(LoadPlan.model_validate(fields))   # llama-server closes them
            try:
                samples.append(ok(client.measure(cls, random.Random(i))))
            finally:
                client.close()
    exchanges = list(tap.exchanges())
    assert len(exchanges) == len(samples)
    ttft, itl, span = [], 0.0, 0.0
    for s, ex in zip(samples, exchanges, strict=True):
        content = [e for e in ex.events if wire.decode(SSEEvent(data=e.data)).text]
        assert s.content_events == len(content) == s.usage_tokens == WIRE_T, what
        assert s.ttft_ms is not None
        ttft.append(s.ttft_ms - (content[0].t - ex.request_t) * 1000.0)
        itl += sum(s.itl_ms)
        span += (content[-1].t - content[0].t) * 1000.0
    assert itl == pytest.approx(span, rel=0.03), what
    print(f"\n{what}: {WIRE_N} streams, content events = wire = usage = {WIRE_T} in each; "
          f"TTFT - wire p50 {statistics.median(ttft):+.3f} ms; sum of ITL / wire span "
          f"{itl / span:.4f}")


@pytest.mark.timeout(120)
def test_transformers_serve_streams_match_the_wire(wire: str) -> None:
    against_the_wire(int(wire.rsplit(":", 1)[1]), "openai", None, None,
                     "transformers serve's bytes (no [DONE])")


@pytest.mark.timeout(300)
def test_llama_server_streams_of_each_format_match_the_wire(engine: LlamaServer) -> None:
    port = int(engine.url.rsplit(":", 1)[1])
    against_the_wire(port, "openai", "/v1/completions",
                     {"prompt": PROMPT, "max_tokens": WIRE_T, **EXACT_LENGTH},
                     "llama-server /v1/completions (openai)")
    against_the_wire(port, "llama_cpp", None,
                     {"prompt": PROMPT, "n_predict": WIRE_T, **EXACT_LENGTH},
                     "llama-server /completion (llama_cpp)")
    against_the_wire(port, "openai_responses", None,
                     {"input": PROMPT, "max_output_tokens": WIRE_T, **EXACT_LENGTH},
                     "llama-server /v1/responses (openai_responses)")
