"""Faults in a tool call's stream (issue 32): the SSE proxy spoils a streamed tool call's JSON
arguments (``tool_call: {mode: cut | duplicate | reorder}``): it cuts the argument chunks after
the first, sends the first twice, or swaps the first two, in each format's own events (OpenAI
chat's ``delta.tool_calls[].function.arguments``, Anthropic's ``input_json_delta``, the Responses
API's ``response.function_call_arguments.delta``), and counts what it did. The client joins each
call's chunks and counts a call whose arguments do not parse at the stream's end as
``tool_call``, saying what was wrong.

Real processes on loopback: the embedded target (``tool_call: true``), the proxy process in
front of it, the client (directly, and in a real ``streamquake run``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from streamquake import protocols
from streamquake.embedded.formats import tool_piece
from streamquake.errors import ScenarioError
from streamquake.faults.proxy.framing import SSEFramer, parse_event, tool_args_delta
from streamquake.faults.proxy.server import ProxyProcess
from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.loadgen.failures import _Failed
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.tally import _ToolCall
from streamquake.protocols import Completion, GenRequest, Protocol, ToolDelta
from streamquake.reports.csv_report import iter_samples
from streamquake.scenario import load_scenario
from tests import one_request
from tests.conftest import run_cli
from tests.helpers import spared_by_fault
from tests.one_request import control, proxied_target

TOKENS = 10
FAST = {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": TOKENS, "max": TOKENS}, "seed": 3,
        "tool_call": True}
# The formats that stream a call's arguments in chunks (Gemini sends a call whole).
STREAMED: list[Protocol] = ["openai", "anthropic", "openai_responses"]
# Each mode, the proxy's count of it, the argument events the client then sees, and its words.
MODES = [
    ("cut", "tool_calls_cut", 1, "ended with its JSON arguments unclosed after 1 argument"),
    ("duplicate", "tool_chunks_duplicated", TOKENS + 1, "arguments that are not valid JSON"),
    ("reorder", "tool_chunks_reordered", TOKENS, "not valid JSON after 10 argument deltas"),
]
COUNTERS = ("tool_calls_cut", "tool_chunks_duplicated", "tool_chunks_reordered")


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyProcess]:
    with proxied_target(FAST) as p:
        yield p


def measure(base_url: str, protocol: str, max_tokens: int = 16) -> RequestSample:
    return one_request.measure(base_url, protocol, prompt="look it up", max_tokens=max_tokens)


# --- through a real proxy and target --------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", STREAMED)
def test_each_mode_spoils_the_calls_arguments_and_the_client_counts_it_as_tool_call(
        proxy: ProxyProcess, protocol: str) -> None:
    clean = measure(proxy.url, protocol)
    assert (clean.error, clean.tool_events) == (None, TOKENS), clean.error_detail
    for mode, counter, events, says in MODES:
        control(proxy, "PUT", "/faults/spoil", {"tool_call": {"mode": mode}})
        try:
            samples = [measure(proxy.url, protocol) for _ in range(2)]
        finally:
            stats = control(proxy, "DELETE", "/faults/spoil")["stats"]
        for s in samples:
            # The stream ends as it would (status 200, its finish reason), the call spoilt.
            assert (s.error, s.status, s.tool_events) == ("tool_call", 200, events), \
                (mode, s.error, s.error_detail)
            assert says in (s.error_detail or ""), (mode, s.error_detail)
            assert s.finish_reason == clean.finish_reason is not None
        assert {c: stats[c] for c in COUNTERS} == {c: 2 * (c == counter) for c in COUNTERS}, \
            (mode, stats)
        after = measure(proxy.url, protocol)
        assert (after.error, after.tool_events) == (None, TOKENS), (mode, after.error_detail)


@pytest.mark.timeout(60)
def test_a_call_sent_whole_and_a_text_answer_are_left_alone(
        proxy: ProxyProcess) -> None:
    control(proxy, "PUT", "/faults/spoil", {"tool_call": {"mode": "duplicate"}})
    try:
        # Gemini sends its functionCall whole, once complete: there are no chunks to spoil.
        gemini = measure(proxy.url, "gemini")
    finally:
        stats = control(proxy, "DELETE", "/faults/spoil")["stats"]
    assert (gemini.error, gemini.tool_events) == (None, 1), gemini.error_detail
    assert all(stats[c] == 0 for c in COUNTERS) and stats["requests"] == 1, stats
    with proxied_target({**FAST, "tool_call": False}) as p:
        control(p, "PUT", "/faults/spoil", {"tool_call": {"mode": "reorder"}})
        answer = measure(p.url, "openai")
        stats = control(p, "GET", "/stats")["faults"]["spoil"]
    assert (answer.error, answer.content_events, answer.tool_events) == (None, TOKENS, 0)
    assert all(stats[c] == 0 for c in COUNTERS), stats


@pytest.mark.timeout(60)
def test_probability_spoils_a_seeded_share_and_the_counts_agree(proxy: ProxyProcess) -> None:
    control(proxy, "PUT", "/faults/half", {"tool_call": {"mode": "reorder", "probability": 0.5},
                                           "seed": 7})
    try:
        samples = [measure(proxy.url, "anthropic") for _ in range(12)]
    finally:
        stats = control(proxy, "DELETE", "/faults/half")["stats"]
    failed = [s for s in samples if s.error is not None]
    assert all(s.error == "tool_call" for s in failed), [s.error_detail for s in failed]
    assert 0 < len(failed) < 12
    assert stats["tool_chunks_reordered"] == len(failed) and stats["requests"] == 12, stats


@pytest.mark.timeout(60)
def test_a_stream_begun_before_the_fault_is_spared_and_the_next_is_not() -> None:
    with proxied_target({**FAST, "itl": "60ms"}) as p:     # 10 tokens: ~0.6 s
        early: list[RequestSample] = []
        reader = threading.Thread(target=lambda: early.append(measure(p.url, "openai")))
        reader.start()
        deadline = time.monotonic() + 10.0
        # The call's opening chunk and two argument chunks are through before the fault.
        while control(p, "GET", "/stats")["totals"]["events_forwarded"] < 4:
            assert time.monotonic() < deadline, "the first stream never began"
            time.sleep(0.02)
        control(p, "PUT", "/faults/spoil", {"tool_call": {"mode": "cut"}})
        reader.join(20)
        late = measure(p.url, "openai")
        stats = control(p, "GET", "/stats")["faults"]["spoil"]
    (first,) = early
    assert (first.error, first.tool_events) == (None, TOKENS), first.error_detail
    assert (late.error, late.tool_events) == ("tool_call", 1), late.error_detail
    assert stats["tool_calls_cut"] == 1, stats


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "events"), [("cut", 1), ("reorder", TOKENS)])
def test_a_call_spoilt_as_it_began_stays_so_when_the_fault_goes_off_mid_stream(
        mode: str, events: int) -> None:
    with proxied_target({**FAST, "itl": "60ms"}) as p:     # 10 tokens: ~0.6 s
        control(p, "PUT", "/faults/spoil", {"tool_call": {"mode": mode}})
        got: list[RequestSample] = []
        reader = threading.Thread(target=lambda: got.append(measure(p.url, "openai")))
        reader.start()
        deadline = time.monotonic() + 10.0
        # The call's opening chunk and its first argument chunk have come (and gone, or not).
        while control(p, "GET", "/stats")["totals"]["events_seen"] < 3:
            assert time.monotonic() < deadline, "the stream never began"
            time.sleep(0.01)
        # Off, with nothing else on: the proxy would pass the rest on unread, but for this call.
        stats = control(p, "DELETE", "/faults/spoil")["stats"]
        reader.join(20)
    (s,) = got
    assert (s.error, s.tool_events) == ("tool_call", events), s.error_detail
    # Counted as its fate was set (the first chunk): in the record taken as the fault went off.
    assert stats["tool_calls_cut" if mode == "cut" else "tool_chunks_reordered"] == 1, stats
    if mode == "reorder":   # the first chunk was held till the second came: swapped
        assert "character 0" in (s.error_detail or ""), s.error_detail


# --- each format's argument chunks, as the proxy recognises them ----------------------------


def _encoded(protocol: Protocol) -> list[bytes]:
    """The events the format's own encoder sends for a three-chunk tool call."""
    wire = protocols.get(protocol)
    enc = wire.encoder(GenRequest(model="m-1", prompt_tokens=3, max_tokens=16), ids=False)
    enc.tool_name = "search"
    body = enc.opening()
    for i in range(3):
        body += enc.tool_args(tool_piece(i, i == 0, i == 2), i == 0, i == 2)
    body += enc.closing(Completion(3, False))
    return SSEFramer().feed(body)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("protocol", STREAMED)
def test_each_formats_argument_chunks_and_nothing_else_are_recognised(protocol: Protocol) -> None:
    wire = protocols.get(protocol)
    chunks = []
    for raw in _encoded(protocol):
        ev = parse_event(raw)
        if ev is not None and (delta := tool_args_delta(ev, wire)) is not None:
            chunks.append(delta)
    # Three argument chunks of one call, joining to its JSON; the call's opening event (id,
    # name, empty arguments), the finish and the end are not chunks.
    assert len(chunks) == 3 and len({c.key for c in chunks}) == 1, chunks
    assert json.loads("".join(c.piece for c in chunks))["query"]


class _Ev:
    def __init__(self, data: str, event: str = "message") -> None:
        self.data, self.event = data, event


@pytest.mark.timeout(10)
def test_chunks_as_real_servers_send_them_and_events_that_are_not_chunks() -> None:
    openai, anthropic = protocols.get("openai"), protocols.get("anthropic")
    responses, gemini = protocols.get("openai_responses"), protocols.get("gemini")
    args = ('{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
            '{"tool_calls":[{"index":1,"function":{"arguments":"{\\"loc"}}]},'
            '"finish_reason":null}]}')
    assert openai.tool_args_delta(_Ev(args)) == ToolDelta("0:1", '{"loc')   # choice:call
    assert anthropic.tool_args_delta(_Ev(
        '{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
        '"partial_json":"{\\"city\\": "}}', "content_block_delta")) == ToolDelta("1", '{"city": ')
    assert responses.tool_args_delta(_Ev(
        '{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":0,'
        '"delta":"{\\"q"}', "response.function_call_arguments.delta")) == ToolDelta("fc_1", '{"q')
    for wire, data in [
        # Opening a call: its id and name, no arguments yet (Anthropic's first delta is empty).
        (openai, '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1",'
                 '"type":"function","function":{"name":"f","arguments":""}}]}}]}'),
        (anthropic, '{"type":"content_block_delta","index":1,"delta":{"type":'
                    '"input_json_delta","partial_json":""}}'),
        # Text, a finish, and what is not the format's at all.
        (openai, '{"choices":[{"index":0,"delta":{"content":"Hi"}}]}'),
        (openai, '{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}'),
        (openai, "[DONE]"),
        (openai, "not json"),
        (anthropic, '{"type":"content_block_delta","index":0,"delta":"oops"}'),
        (responses, '{"type":"response.function_call_arguments.done","item_id":"fc_1",'
                    '"arguments":"{}"}'),
        # Gemini's call comes whole: nothing to cut, repeat or swap.
        (gemini, '{"candidates":[{"content":{"parts":[{"functionCall":{"name":"f","args":'
                 '{"q":1}}}]}}]}'),
    ]:
        assert wire.tool_args_delta(_Ev(data)) is None, (wire.name, data)


@pytest.mark.timeout(10)
def test_the_clients_check_says_what_was_wrong_and_never_crashes() -> None:
    def failure(*pieces: str) -> str | None:
        call = _ToolCall()
        for p in pieces:
            call.add(ToolDelta("0", p, "f"))
        try:
            call.check("tool_calls")
        except _Failed as exc:
            assert exc.kind == "tool_call"
            return str(exc)
        return None

    assert failure('{"q": ', '"x"}') is None
    assert "unclosed after 1 argument deltas" in (failure('{"q": ') or "")
    assert "unclosed" in (failure('{"q": "x"  ') or "")
    said = failure('{"q": "a ', '{"q": "a ', 'b"}') or ""
    assert "not valid JSON after 3 argument deltas (finish reason 'tool_calls')" in said, said
    assert "at character 11, as when a chunk is repeated" in said and "near" not in said, said
    assert "repeated, reordered or garbled" in said
    # A chunk repeated that leaves a valid beginning is told as what it looks like: unclosed.
    assert "unclosed after 3" in (failure('{"q": ', '{"q": ', '"x"}') or "")
    assert "not valid JSON" in (failure('"x"}', '{"q": ') or "")
    assert "not valid JSON" in (failure("\x00\ud800", "}}") or "")


# --- bad settings ------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_bad_tool_call_settings_say_what_to_change() -> None:
    for bad, words in [
        ({"mode": "shuffle"}, "'cut', 'duplicate' or 'reorder'"),
        ({}, "mode"),
        ({"mode": "cut", "probability": "150%"}, "probability"),
        ({"mode": "cut", "protocol": "grpc"}, "openai"),
        ({"mode": "cut", "colour": "red"}, "colour"),
        ("cut", "valid dictionary"),
    ]:
        with pytest.raises(ValidationError) as info:
            SSEProxyFault.model_validate({"type": "sse_proxy", "tool_call": bad})
        assert words in str(info.value) and "tool_call" in str(info.value), (bad, info.value)


SCENARIO = """\
name: tool-chunks
target:
  protocol: {protocol}
  model: sim-1
  embedded: {{ttft: 20ms, itl: 4ms, output_tokens: {{min: 10, max: 10}}, tool_call: true,
             seed: 4}}
  timeout: 10s
load:
  users: 2
  think_time: {{min: 40ms, max: 60ms}}
  classes:
    - {{name: agent, prompt: "Look it up.", max_tokens: 16}}
  seed: 4
phases: {{warmup: 0s, baseline: 2s, fault: 2s, recovery: 2s}}
faults:
  - type: sse_proxy
    name: spoil
    phase: fault
    tool_call:
      mode: {mode}
slos:
  - {{metric: error_rate, max: 1%, phases: [baseline, recovery]}}
"""


@pytest.mark.timeout(10)
def test_a_bad_mode_in_a_scenario_is_located(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(SCENARIO.format(protocol="openai", mode="shuffle"))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    said = str(info.value)
    # The file, line and column of `mode`, the field, and the values it takes.
    assert said.startswith(f"{path}:20:7: faults.0.tool_call.mode: Input should be 'cut', "
                           "'duplicate' or 'reorder' (hint: use one of the values listed)"), said


# --- a real run --------------------------------------------------------------------------------

RUN = """\
name: tool-chunks-run
target:
  protocol: anthropic
  model: sim-1
  embedded: {ttft: 20ms, itl: 4ms, output_tokens: {min: 8, max: 12}, tool_call: true, seed: 5}
  timeout: 10s
load:
  users: 2
  think_time: {min: 40ms, max: 60ms}
  classes:
    - {name: agent, prompt: "Look it up.", max_tokens: 16}
  seed: 5
faults:
  - {type: sse_proxy, name: cut, tool_call: {mode: cut}}
  - {type: sse_proxy, name: duplicate, tool_call: {mode: duplicate}}
  - {type: sse_proxy, name: reorder, tool_call: {mode: reorder, probability: 50%}, seed: 5}
steps:
  - {name: before, kind: baseline, duration: 2s}
  - {name: cut, kind: fault, duration: 2s, faults: [cut]}
  - {name: duplicate, kind: fault, duration: 2s, faults: [duplicate]}
  - {name: reorder, kind: fault, duration: 2s, faults: [reorder]}
  - {name: after, kind: recovery, duration: 2s}
slos:
  - {metric: error_rate, max: 1%, phases: [baseline, recovery]}
"""


@pytest.mark.timeout(120)
def test_a_run_counts_each_steps_spoilt_calls_in_that_step_only(tmp_path: Path) -> None:
    scenario = tmp_path / "tool.yaml"
    scenario.write_text(RUN)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=100)
    assert proc.returncode in (0, 1, 6), proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p["stats"] for p in report["phases"]}
    errors = {name: stats["errors"] for name, stats in phases.items()}
    done = {f["name"]: f["reverted"]["stats"] for f in report["faults"]}
    samples = list(iter_samples(out / "run" / "samples"))
    for name, counter in zip(("cut", "duplicate", "reorder"), COUNTERS, strict=True):
        # The proxy's count of what it did is the client's count of tool_call errors in that
        # step, and it did nothing else.
        assert errors[name]["tool_call"] == done[name][counter] > 0, (name, errors, done)
        assert sum(errors[name].values()) == done[name][counter], (name, errors)
        assert all(done[name][c] == 0 for c in COUNTERS if c != counter), (name, done)
        if name != "reorder":
            # Every stream but those of the step's requests sent before its fault was applied
            # or still running when it was reverted (due in the step's last tens of ms: two a
            # run on a quiet machine, three on a busy one).
            spared = spared_by_fault(report, samples, name, name)
            assert done[name][counter] >= phases[name]["requests"] - spared, (
                name, phases[name], spared)
    reorder = phases["reorder"]
    assert 0 < reorder["errors"]["tool_call"] < reorder["requests"], reorder
    for name in ("before", "after"):
        assert phases[name]["successes"] > 0 and not any(errors[name].values()), (name, errors)
