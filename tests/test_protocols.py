"""protocols/: the registry, each format's round trip, and the content rule the proxy relies on.

The round trip is the seam between the three parts that speak a format: what the target encodes,
the load generator must read back exactly, and the proxy (which may not know the format) must
count as content exactly the events the format itself does, since its drop rate is
``events_dropped / content_events`` and a dropped non-content event can hang a client.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import typing

import pytest

from streamquake import protocols
from streamquake.embedded.formats import TOKEN_JSON, tool_piece
from streamquake.faults.proxy import framing
from streamquake.loadgen.sse_parser import SSEEvent, SSEParser
from streamquake.protocols import Completion, Protocol, ProtocolError, openai

NAMES = typing.get_args(Protocol)
# Words as the target sends them, plus what a real model may send: non-ASCII (escaped by JSON),
# quotes, a newline, whitespace only, and text that looks like a control payload.
TOKENS = ("the ", "quick ", "héllo ", 'say "hi" ', "two\nlines ", " ", "🎉 ", "[DONE] ", "{} ")


# --- the registry ------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_every_protocol_name_has_a_module_and_every_module_a_name() -> None:
    modules = {m.name for m in pkgutil.iter_modules(protocols.__path__)
               if not m.name.startswith("_") and m.name != "base"}
    assert modules == set(NAMES)
    assert set(protocols.names()) == set(NAMES) and len(protocols.names()) == len(NAMES)
    for name in NAMES:
        module = importlib.import_module(f"streamquake.protocols.{name}")
        assert module.PROTOCOL.name == name
        assert protocols.get(name) is module.PROTOCOL
    with pytest.raises(LookupError, match="known: gemini, openai, anthropic, sse"):
        protocols.get("grpc")


# --- encode, decode, and the content rule, per format -------------------------------------------


def _stream(name: str, *, ids: bool, truncated: bool) -> bytes:
    """What the target sends for TOKENS, from a request the load generator built."""
    wire = protocols.get(name)
    request = wire.parse(wire.body("m-1", "a short prompt", 64), "m-1")
    enc = wire.encoder(request, ids)
    return (enc.opening() + b"".join(enc.token(json.dumps(t).encode()) for t in TOKENS)
            + enc.closing(Completion(len(TOKENS), truncated)))


def _client_events(raw: bytes) -> list[SSEEvent]:
    whole = SSEParser().feed(raw)
    # The same events whatever the read boundaries (a CRLF may be split, as Gemini's are).
    parser = SSEParser()
    assert [e for i in range(0, len(raw), 7) for e in parser.feed(raw[i:i + 7])] == whole
    return whole


def _proxy_events(raw: bytes) -> list[framing.SSEEvent]:
    """The events as the proxy cuts them: the blocks of one read, then what ``flush`` leaves."""
    framer = framing.SSEFramer()
    blocks = framer.feed(raw)
    blocks.append(framer.flush())
    assert b"".join(blocks) == raw
    return [ev for ev in map(framing.parse_event, blocks) if ev is not None]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("ids", "truncated"), [(True, False), (False, True)])
def test_client_reads_back_exactly_what_the_target_encoded(name: str, ids: bool,
                                                           truncated: bool) -> None:
    wire = protocols.get(name)
    decoded = [wire.decode(e) for e in _client_events(_stream(name, ids=ids, truncated=truncated))]
    assert [d.text for d in decoded if d.text] == list(TOKENS)
    assert [d.done for d in decoded] == [False] * (len(decoded) - 1) + [True]
    assert [d.usage_output_tokens for d in decoded if d.usage_output_tokens][-1] == len(TOKENS)
    assert all(d.error is None for d in decoded)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("ids", "truncated"), [(True, False), (False, True)])
def test_sniffing_and_the_formats_rule_agree_on_every_event(name: str, ids: bool,
                                                            truncated: bool) -> None:
    wire = protocols.get(name)
    raw = _stream(name, ids=ids, truncated=truncated)
    client, proxy = _client_events(raw), _proxy_events(raw)
    assert len(client) == len(proxy)
    for c, p in zip(client, proxy, strict=True):
        own = wire.is_content_event(c)
        assert framing.is_content_event(p) is own, (c.event, c.data)
        assert framing.is_content_event(p, name) is own, (c.event, c.data)
        # On the target's events, content is exactly what the client counts as text.
        assert own is bool(wire.decode(c).text), (c.event, c.data)
    assert sum(map(wire.is_content_event, client)) == len(TOKENS)


# Real-API events the target does not send. Where the two rules differ, the format's own rule is
# the stricter one, and the difference is written here on purpose.
REAL_EVENTS: list[tuple[str, str, object, bool, bool]] = [
    # (format, event name, data, the format's rule, sniffing)
    ("openai", "message", {"choices": [{"delta": {"reasoning_content": "hmm"},
                                        "finish_reason": None}]}, True, True),
    ("openai", "message", {"choices": [{"delta": {"refusal": "no"}, "finish_reason": None}]},
     True, True),
    ("openai", "message", {"choices": [{"delta": {"content": "end"}, "finish_reason": "stop",
                                        "stop_reason": None}]}, False, False),
    # A tool call's argument delta is generated text the client counts (as Anthropic's and
    # the Responses API's are); sniffing does not know `arguments`, so a proxy that does not
    # know the format leaves it alone. The delta that opens the call (its name) never is.
    ("openai", "message", {"choices": [{"delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "{\"a\""}}]}, "finish_reason": None}]},
     True, False),
    ("openai", "message", {"choices": [{"delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "search", "arguments": ""}}]}, "finish_reason": None}]},
     False, False),
    ("openai", "message", {"choices": [{"delta": {"reasoning": "hmm"},
                                        "finish_reason": None}]}, True, False),
    ("openai", "message", {"error": {"message": "overloaded", "type": "server_error"}},
     False, False),
    ("anthropic", "content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "thinking_delta", "thinking": "t"}},
     True, True),
    ("anthropic", "content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
        "type": "input_json_delta", "partial_json": "{\"a\""}}, True, True),
    ("anthropic", "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "signature_delta", "signature": "EqQB"}}, False, False),
    ("anthropic", "content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": "pre"}},
     False, False),
    ("anthropic", "error", {"type": "error", "error": {"type": "overloaded_error",
                                                       "message": "Overloaded"}}, False, False),
    ("gemini", "message", {"candidates": [{"content": {"parts": [
        {"text": "plan", "thought": True}], "role": "model"}, "index": 0}]}, True, True),
    ("gemini", "message", {"candidates": [{"content": {"parts": [{"text": "last"}]},
                                           "finishReason": "STOP"}],
                           "usageMetadata": {"candidatesTokenCount": 9}}, False, False),
    ("gemini", "message", {"promptFeedback": {"blockReason": "SAFETY"}}, False, False),
    ("gemini", "message", {"error": {"code": 429, "message": "Resource exhausted"}},
     False, False),
    # Legacy completions (/v1/completions), read under openai: the choice's own text.
    ("openai", "message", {"object": "text_completion", "choices": [
        {"text": "hi", "index": 0, "logprobs": None, "finish_reason": None}]}, True, True),
    ("openai", "message", {"object": "text_completion", "choices": [
        {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "usage": {"completion_tokens": 16}}, False, False),
    # The Responses API: every string delta is text; the .done events and response.completed
    # repeat the text whole and end the stream, so they never are.
    ("openai_responses", "response.output_text.delta", {
        "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
        "content_index": 0, "delta": "Hi", "sequence_number": 4}, True, True),
    ("openai_responses", "response.function_call_arguments.delta", {
        "type": "response.function_call_arguments.delta", "item_id": "fc_1",
        "output_index": 0, "delta": "{\"a\"", "sequence_number": 5}, True, True),
    ("openai_responses", "response.output_text.done", {
        "type": "response.output_text.done", "item_id": "msg_1", "output_index": 0,
        "content_index": 0, "text": "Hi there", "sequence_number": 9}, False, False),
    ("openai_responses", "response.completed", {
        "type": "response.completed", "sequence_number": 12, "response": {
            "id": "resp_1", "status": "completed", "output": [{"type": "message", "content": [
                {"type": "output_text", "text": "Hi there", "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}},
     False, False),
    ("openai_responses", "error", {"type": "error", "code": "rate_limit_exceeded",
                                   "message": "Slow down", "param": None}, False, False),
    # llama.cpp's native /completion: the stop event ends the stream, with its settings.
    ("llama_cpp", "message", {"index": 0, "content": "hi", "tokens": [42], "stop": False,
                              "id_slot": 0, "tokens_predicted": 1}, True, True),
    ("llama_cpp", "message", {"index": 0, "content": "", "tokens": [], "stop": True,
                              "model": "tiny", "tokens_predicted": 16, "stop_type": "limit",
                              "prompt": "Tell me a story", "stopping_word": "",
                              "generation_settings": {"n_predict": 16, "stop": ["</s>"]},
                              "timings": {"prompt_n": 5, "predicted_n": 16}}, False, False),
    ("llama_cpp", "message", {"error": {"code": 500, "message": "slot unavailable",
                                        "type": "server_error"}}, False, False),
    ("sse", "message", {"text": "w ", "usage": {"output_tokens": 3}}, True, True),
    ("sse", "message", "[DONE]", False, False),
    # Sniffing does not know the generic format's "done" key; the format's rule does.
    ("sse", "message", {"text": "last ", "done": True}, False, True),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("name", "event", "data", "own", "sniffed"), REAL_EVENTS)
def test_content_rules_on_real_api_events(name: str, event: str, data: object, own: bool,
                                          sniffed: bool) -> None:
    payload = data if isinstance(data, str) else json.dumps(data)
    raw = ("" if event == "message" else f"event: {event}\n") + f"data: {payload}\n\n"
    (client,), (proxy,) = SSEParser().feed(raw.encode()), _proxy_events(raw.encode())
    assert protocols.get(name).is_content_event(client) is own
    assert framing.is_content_event(proxy, name) is own
    assert framing.is_content_event(proxy) is sniffed


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", NAMES)
def test_malformed_payloads_are_a_protocol_error_and_never_content(name: str) -> None:
    wire = protocols.get(name)
    for data in ("", "{\"text\": ", "[1, 2]", "null", "\"text\"", "not json at all"):
        for event in ("message", "content_block_delta"):
            ev = SSEEvent(event=event, data=data)
            assert wire.is_content_event(ev) is False
            with pytest.raises(ProtocolError):
                wire.decode(ev)


# --- requests ----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", NAMES)
def test_what_the_load_generator_sends_the_target_accepts(name: str) -> None:
    wire = protocols.get(name)
    request = wire.parse(wire.body("m-1", "three word prompt", 17), "m-1")
    assert (request.prompt_tokens, request.max_tokens) == (3, 17)
    # A user's own body, once forced to stream, is accepted too (when it is otherwise valid).
    own = wire.force_streaming("m-1", {**wire.body("m-1", "x", 5), "stream": False})
    assert wire.parse(own, "m-1").max_tokens == 5
    assert request.include_usage is (name == "openai")
    headers = wire.headers()
    assert headers["Accept"] == "text/event-stream"
    assert ("anthropic-version" in headers) is (name == "anthropic")


@pytest.mark.timeout(10)
def test_proxy_releases_a_crlf_event_as_soon_as_it_is_complete() -> None:
    event = _stream("gemini", ids=False, truncated=False).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    assert framing.SSEFramer().feed(event) == [event]


# --- the formats a protocol reads beyond its own target's ---------------------------------------


@pytest.mark.timeout(10)
def test_legacy_completions_read_back_under_openai_and_the_rules_agree() -> None:
    wire, legacy = protocols.get("openai"), openai.COMPLETIONS
    body = wire.body_for("/v1/completions", "m-1", "a short prompt", 64)
    assert body["prompt"] == "a short prompt" and "messages" not in body
    assert wire.body_for("/v1/chat/completions", "m-1", "x", 5)["messages"]
    enc = legacy.encoder(legacy.parse(body, None), ids=False)
    raw = b"".join(enc.token(json.dumps(t).encode()) for t in TOKENS) + enc.closing(
        Completion(len(TOKENS), truncated=True))
    events, proxy = _client_events(raw), _proxy_events(raw)
    decoded = [wire.decode(e) for e in events]
    assert [d.text for d in decoded if d.text] == list(TOKENS)
    assert [d.finish for d in decoded if d.finish] == ["length"]
    assert decoded[-1].done and decoded[-2].usage_output_tokens == len(TOKENS)
    for c, p in zip(events, proxy, strict=True):
        assert framing.is_content_event(p) is wire.is_content_event(c) is bool(
            wire.decode(c).text), c.data


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", NAMES)
def test_every_format_says_where_its_text_is(name: str) -> None:
    # For the sentence of a protocol mismatch (run/probe.py, run/mismatch.py).
    assert protocols.get(name).text_is


@pytest.mark.timeout(10)
def test_events_are_described_by_shape_and_the_formats_that_read_them_are_named() -> None:
    raw = _stream("llama_cpp", ids=False, truncated=False)
    events = _client_events(raw)
    text = protocols.describe(events)
    assert text.startswith('event 1 of 10: {"index": number, "content": string, "tokens": [], '
                           '"stop": false')
    assert "event 10: " in text and '"stop": true' in text and "quick" not in text
    others = [protocols.get(n) for n in NAMES if n != "llama_cpp"]
    assert protocols.readers(events, others) == []
    assert protocols.readers(events, [protocols.get("llama_cpp")]) == ["llama_cpp"]
    openai_events = _client_events(_stream("openai", ids=False, truncated=False))
    assert protocols.readers(openai_events, others) == ["openai"]


# --- reasoning and tool calls ------------------------------------------------------------------

# The formats that stream reasoning and tool-call arguments as parts of their own; the others
# send them as text.
PARTS = {"openai", "anthropic", "gemini", "openai_responses"}


def _parts_stream(name: str, *, truncated: bool) -> bytes:
    """The target's answer of 3 reasoning tokens, then a tool call `search` whose arguments
    stream over 5 tokens (closing only when the answer is not cut short)."""
    wire = protocols.get(name)
    enc = wire.encoder(wire.parse(wire.body("m-1", "a short prompt", 64), "m-1"), False)
    enc.reasoning_first, enc.tool_name = True, "search"
    raw = enc.opening()
    for i, word in enumerate(range(8)):
        if i < 3:
            raw += enc.reasoning(TOKEN_JSON[word])
        else:
            last = i == 7 and not truncated
            raw += enc.tool_args(tool_piece(word, i == 3, last), i == 3, last)
    return raw + enc.closing(Completion(8, truncated))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("truncated", [False, True])
def test_reasoning_and_tool_call_arguments_read_back_as_parts_of_their_own(
        name: str, truncated: bool) -> None:
    wire = protocols.get(name)
    events = _client_events(_parts_stream(name, truncated=truncated))
    decoded = [wire.decode(e) for e in events]
    # The content rule holds for these events too: content is what the client counts.
    for e, d in zip(events, decoded, strict=True):
        assert wire.is_content_event(e) is (d.generated and not d.done and not d.finish), e
    assert decoded[-1].done and not any(d.done for d in decoded[:-1])
    if name not in PARTS:
        assert [bool(d.text) for d in decoded].count(True) == 8
        assert not any(d.reasoning or d.tools for d in decoded)
        return
    assert [d.reasoning for d in decoded if d.reasoning] == ["the ", "quick ", "brown "]
    pieces: dict[str, list[str]] = {}
    names = set()
    for d in decoded:
        for t in d.tools:
            pieces.setdefault(t.key, []).append(t.piece)
            names.add(t.name)
    assert not any(d.text for d in decoded)
    if name == "gemini":
        # A call goes whole, once complete: none at all when the answer was cut inside it.
        assert sum(d.tool_args for d in decoded) == (0 if truncated else 1)
        if not truncated:
            assert json.loads(pieces[""][0]) == {"query": "fox jumps over a lazy "}
        return
    (key,) = pieces
    args = "".join(pieces[key])
    assert sum(d.tool_args for d in decoded) == 5 and names == {"search", None}
    assert args == '{"query": "fox jumps over a lazy ' + ('' if truncated else '"}')
    if not truncated:
        assert json.loads(args) == {"query": "fox jumps over a lazy "}
