"""Wire formats: request shapes, decoding of real-API events, and each format off the target."""

from __future__ import annotations

import json
import random
import re
import urllib.request
from collections.abc import Iterator

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.formats import VOCABULARY
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.sse_parser import SSEEvent, SSEParser
from streamquake.loadgen.wire import (
    Decoded,
    ProtocolError,
    build_request,
    decode,
    protocol_headers,
)
from streamquake.protocols import Protocol, ToolDelta

PROTOCOLS: tuple[Protocol, ...] = ("gemini", "openai", "anthropic", "sse")
TOKENS = 8
# Events the target sends per stream, all numbered by ``id:``, for TOKENS tokens.
EVENTS_PER_STREAM = {
    "gemini": TOKENS + 1,                 # a chunk per token, then finishReason + usage
    "openai": 1 + TOKENS + 3,             # role chunk, tokens, finish, usage, [DONE]
    "anthropic": 3 + TOKENS + 3,          # message_start, block start, ping; tokens; 3 closing
    "sse": TOKENS + 1,
}


def ev(data: object, event: str = "message") -> SSEEvent:
    return SSEEvent(event=event, data=data if isinstance(data, str) else json.dumps(data))


# --- requests ----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_request_shapes_follow_the_real_apis() -> None:
    cls = RequestClassPlan(prompts=["Hi there"], max_tokens=32)
    rng = random.Random(0)
    path, body = build_request("gemini", "gemini-2.0-flash", cls, rng)
    assert path == "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse"
    assert body == {"contents": [{"role": "user", "parts": [{"text": "Hi there"}]}],
                    "generationConfig": {"maxOutputTokens": 32}}
    path, body = build_request("openai", "gpt-4o", cls, rng)
    assert path == "/v1/chat/completions"
    assert body == {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi there"}],
                    "max_tokens": 32, "stream": True, "stream_options": {"include_usage": True}}
    path, body = build_request("anthropic", "claude-x", cls, rng)
    assert path == "/v1/messages"
    assert body == {"model": "claude-x", "max_tokens": 32, "stream": True,
                    "messages": [{"role": "user", "content": "Hi there"}]}
    assert protocol_headers("anthropic")["anthropic-version"] == "2023-06-01"
    assert "anthropic-version" not in protocol_headers("openai")
    assert build_request("sse", "m", cls, rng) == (
        "/v1/stream", {"prompt": "Hi there", "max_tokens": 32})


@pytest.mark.timeout(10)
def test_prompts_are_drawn_by_the_seeded_rng_and_full_bodies_still_stream() -> None:
    cls = RequestClassPlan(prompts=[f"p{i}" for i in range(20)])
    draw = [build_request("sse", "m", cls, random.Random(5))[1]["prompt"] for _ in range(3)]
    assert len(set(draw)) == 1
    custom = RequestClassPlan(body={"messages": [{"role": "user", "content": "x"}],
                                    "stream": False, "temperature": 0})
    _, body = build_request("openai", "gpt-4o", custom, random.Random(0))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "gpt-4o" and body["temperature"] == 0
    assert custom.body is not None and custom.body["stream"] is False   # not mutated


# --- decoding of real-API events ---------------------------------------------------------------


@pytest.mark.timeout(10)
def test_openai_role_usage_done_and_error_events() -> None:
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert decode("openai", ev(chunk)) == Decoded(response_id="c")
    chunk["choices"][0]["delta"] = {"content": "Hello"}  # type: ignore[index]
    assert decode("openai", ev(chunk)) == Decoded(text="Hello", response_id="c")
    chunk["choices"][0]["delta"] = {}  # type: ignore[index]
    chunk["choices"][0]["finish_reason"] = "stop"  # type: ignore[index]
    chunk["model"] = "tiny"
    assert decode("openai", ev(chunk)) == Decoded(response_id="c", finish="stop", model="tiny")
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 17}}
    assert decode("openai", ev(usage)) == Decoded(usage_output_tokens=17, response_id="c")
    assert decode("openai", ev("[DONE]")) == Decoded(done=True)
    err = {"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit"}}
    assert decode("openai", ev(err)).error == "requests: Rate limit reached"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("data", "says"), [
    ({"id": "c", "choices": None}, "`choices` is null or missing, not a list"),
    ({"id": "c"}, "`choices` is null or missing, not a list"),
    ({"choices": {"0": {"delta": {"content": "x"}}}}, "`choices` is an object, not a list"),
    ({"choices": "x", "usage": {"completion_tokens": 1}}, "`choices` is a string, not a list"),
    ({"choices": ["x"]}, "a choice that is not an object"),
    ({"choices": [None]}, "a choice that is not an object"),
    ({"choices": [{"delta": {"content": "x"}}, 7]}, "a choice that is not an object"),
    ({"choices": [{"delta": "x"}]}, "with an object `delta`"),
    ({"choices": [{"delta": ["x"]}]}, "with an object `delta`"),
    ({"choices": [{"delta": 0, "finish_reason": "stop"}]}, "with an object `delta`"),
])
def test_openai_wrong_shaped_chunks_are_protocol_errors(data: object, says: str) -> None:
    # The per-event decode takes shortcuts (exact types, no list for the text): each wrong
    # shape must still be caught, and named.
    with pytest.raises(ProtocolError, match=re.escape(says)):
        decode("openai", ev(data))


@pytest.mark.timeout(10)
def test_openai_texts_of_every_choice_are_joined_and_odd_values_ignored() -> None:
    chunk = {"id": 5, "model": ["m"], "choices": [
        {"delta": {"reasoning_content": "think ", "content": "say"}, "finish_reason": None},
        {"delta": None},
        {"delta": {"content": 3, "reasoning_content": ""}},
        {"delta": {"content": "!"}, "finish_reason": "length"}],
        "usage": {"completion_tokens": True}}
    # Reasoning is a part of its own, apart from the answer's text (issue 31).
    assert decode("openai", ev(chunk)) == Decoded(text="say!", finish="length",
                                                  reasoning="think ")
    assert decode("openai", ev({"usage": {"completion_tokens": 4}})) == \
        Decoded(usage_output_tokens=4)
    assert decode("openai", ev(" [DONE]\n")) == Decoded(done=True)


@pytest.mark.timeout(10)
def test_anthropic_events() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1},
                                                  "model": "claude-x"}}
    assert decode("anthropic", ev(start, "message_start")) == Decoded(model="claude-x")
    assert decode("anthropic", ev({"type": "ping"}, "ping")) == Decoded()
    delta = {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "Hi"}}
    assert decode("anthropic", ev(delta, "content_block_delta")) == Decoded(text="Hi")
    tool = {"type": "content_block_delta", "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "{\"a\""}}
    assert decode("anthropic", ev(tool, "content_block_delta")) == Decoded(
        tools=(ToolDelta("1", "{\"a\""),))      # a tool call's arguments (issue 31)
    md = {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
          "usage": {"output_tokens": 15}}
    assert decode("anthropic", ev(md, "message_delta")) == Decoded(usage_output_tokens=15,
                                                                   finish="end_turn")
    assert decode("anthropic", ev({"type": "message_stop"}, "message_stop")).done
    err = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert decode("anthropic", ev(err, "error")).error == "overloaded_error: Overloaded"


@pytest.mark.timeout(10)
def test_gemini_events() -> None:
    chunk = {"candidates": [{"content": {"parts": [{"text": "Hel"}, {"text": "lo"}],
                                         "role": "model"}, "index": 0}],
             "usageMetadata": {"promptTokenCount": 4, "totalTokenCount": 4}}
    assert decode("gemini", ev(chunk)) == Decoded(text="Hello")
    last = {"candidates": [{"content": {"parts": [{"text": ""}], "role": "model"},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 9,
                              "thoughtsTokenCount": 3, "totalTokenCount": 16}}
    assert decode("gemini", ev(last)) == Decoded(usage_output_tokens=12, done=True,
                                                 finish="STOP", usage_reasoning_tokens=3)
    err = {"error": {"code": 429, "message": "Resource exhausted", "status": "RESOURCE_EXHAUSTED"}}
    assert decode("gemini", ev(err)).error == "RESOURCE_EXHAUSTED: Resource exhausted"
    blocked = {"promptFeedback": {"blockReason": "SAFETY"}}
    assert decode("gemini", ev(blocked)).error == "prompt blocked: SAFETY"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unparseable_or_non_object_json_is_a_protocol_error(protocol: Protocol) -> None:
    for data in ("{\"text\": ", "[1, 2]", "not json at all"):
        with pytest.raises(ProtocolError):
            decode(protocol, ev(data, "content_block_delta" if protocol == "anthropic" else
                                "message"))


# --- every format, off the embedded target -----------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    config = TargetConfig.model_validate(
        {"ttft": "20ms", "itl": "2ms", "output_tokens": {"min": TOKENS, "max": TOKENS},
         "sse_event_ids": True})   # numbered events: these tests count lost chunks too
    with start_target(config) as proc:
        yield proc


def _plan(url: str, protocol: Protocol) -> LoadPlan:
    return LoadPlan(base_url=url, protocol=protocol, samples_path="/nonexistent", end_at=0.0,
                    timeout_s=10.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_target_stream_decodes_to_its_tokens(target: TargetProcess, protocol: Protocol) -> None:
    plan = _plan(target.url, protocol)
    path, body = build_request(protocol, plan.model, RequestClassPlan(max_tokens=64),
                               random.Random(0))
    request = urllib.request.Request(target.url + path, data=json.dumps(body).encode(),
                                     headers=protocol_headers(protocol), method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        raw = resp.read()
    events = SSEParser().feed(raw)
    decoded = [decode(protocol, e) for e in events]
    words = "".join(d.text for d in decoded).split()
    assert len(words) == TOKENS and set(words) <= set(VOCABULARY)
    assert [d.done for d in decoded].count(True) == 1 and decoded[-1].done
    assert [d.usage_output_tokens for d in decoded if d.usage_output_tokens is not None][-1] \
        == TOKENS
    assert all(d.error is None for d in decoded)
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_client_measures_each_format_from_the_target(target: TargetProcess,
                                                     protocol: Protocol) -> None:
    client = StreamClient(_plan(target.url, protocol))
    try:
        s = client.measure(RequestClassPlan(max_tokens=64), random.Random(0))
    finally:
        client.close()
    assert s.error is None, s.error_detail
    assert (s.content_events, s.usage_tokens, s.output_tokens) == (TOKENS, TOKENS, TOKENS)
    assert (s.missing_events, s.expected_events) == (0, EVENTS_PER_STREAM[protocol])
    assert len(s.itl_ms) == TOKENS - 1 and s.status == 200
    assert s.ttfb_ms is not None and s.ttft_ms is not None and s.e2e_ms is not None
    assert s.ttfb_ms <= s.ttft_ms <= s.e2e_ms
