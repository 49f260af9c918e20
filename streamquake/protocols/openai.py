"""OpenAI chat completions (``POST /v1/chat/completions``, ``"stream": true``), and legacy
completions (``POST /v1/completions``) at that path.

Also what vLLM, TGI, SGLang, llama-server and most OpenAI-compatible servers speak. The stream is
``chat.completion.chunk`` objects, a finish chunk, an optional usage chunk and ``data: [DONE]``;
legacy completions send ``text_completion`` chunks whose choices hold ``text`` instead of a
``delta``, and this one reader reads both. A stream is complete at ``[DONE]``, or when the body
ends cleanly after a finish reason: Hugging Face ``transformers serve`` never sends ``[DONE]``.
"""

from __future__ import annotations

import time
import uuid

import orjson

from streamquake.jsontypes import JsonDict
from streamquake.protocols import _requests as req
from streamquake.protocols._json import (
    TOKEN_MARK,
    dumps,
    error_text,
    int_or_none,
    json_object,
    nonempty_str,
    not_an_object,
    object_or_none,
    prompt_timings,
    shape,
    short,
    split,
)
from streamquake.protocols.base import (
    BadRequest,
    Completion,
    Decoded,
    Event,
    GenRequest,
    ProtocolError,
    Route,
    StreamEncoder,
    ToolDelta,
    WireProtocol,
)

# The thinking that llama-server, vLLM and DeepSeek stream before the answer: reasoning_content
# (llama-server, DeepSeek, vLLM up to 0.10), reasoning (vLLM since, OpenRouter).
_REASONING_KEYS = ("reasoning_content", "reasoning")
# A refusal is generated text too; the client does not count it, but dropping it loses text only.
_CONTENT_KEYS = ("content", *_REASONING_KEYS, "refusal")


def _bad_choice(data: str) -> ProtocolError:
    return ProtocolError("a chunk with a choice that is not an object with an object `delta`: "
                         f"{short(data)!r}")


def _tool_deltas(calls: object, choice: object, data: str) -> tuple[ToolDelta, ...]:
    """``delta.tool_calls``: each call's ``index`` (else its ``id``) within its choice tells
    it apart; ``function.name`` opens it, ``function.arguments`` is the next piece."""
    if type(calls) is not list:
        raise ProtocolError(f"a delta whose `tool_calls` is {shape(calls)}, not a list: "
                            f"{short(data)!r}")
    out = []
    for i, call in enumerate(calls):
        if type(call) is not dict:
            raise ProtocolError(f"a tool call delta that is not an object: {short(data)!r}")
        index, cid = call.get("index"), call.get("id")
        key = index if type(index) is int else cid if type(cid) is str else i
        function = call.get("function")
        fn = function if type(function) is dict else {}
        args, name = fn.get("arguments"), fn.get("name")
        piece = args if type(args) is str else "" if args is None else dumps(args).decode()
        out.append(ToolDelta(f"{choice}:{key}", piece, name if type(name) is str else None))
    return tuple(out)


class OpenAIEncoder(StreamEncoder):
    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self.response_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self._base = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": request.model,
            "system_fingerprint": "fp_streamquake",
        }
        self._head, self._tail = split(self._chunk({"content": TOKEN_MARK}, None))
        self._first = True
        self._called = False          # the answer was a tool call (finish_reason tool_calls)
        self._reasoning: tuple[bytes, bytes] | None = None
        self._args: tuple[bytes, bytes] | None = None

    def _chunk(self, delta: dict[str, object], finish: str | None) -> dict[str, object]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._base, "choices": [choice]}

    def _role(self) -> bytes:
        # Like the real API, the role chunk arrives with the first token, not before it.
        if not self._first:
            return b""
        self._first = False
        return self._event(dumps(self._chunk({"role": "assistant", "content": ""}, None)))

    def token(self, text_json: bytes) -> bytes:
        return self._role() + self._event(self._head + text_json + self._tail)

    def reasoning(self, text_json: bytes) -> bytes:
        if self._reasoning is None:
            self._reasoning = split(self._chunk({"reasoning_content": TOKEN_MARK}, None))
        head, tail = self._reasoning
        return self._role() + self._event(head + text_json + tail)

    def tool_args(self, piece_json: bytes, first: bool, last: bool) -> bytes:
        out = self._role()
        if self._args is None:
            self._called = True
            call = {"index": 0, "id": f"call_{(self.response_id or '')[-24:]}", "type": "function",
                    "function": {"name": self.tool_name or "tool", "arguments": ""}}
            out += self._event(dumps(self._chunk({"tool_calls": [call]}, None)))
            self._args = split(self._chunk(
                {"tool_calls": [{"index": 0, "function": {"arguments": TOKEN_MARK}}]}, None))
        head, tail = self._args
        return out + self._event(head + piece_json + tail)

    def closing(self, done: Completion) -> bytes:
        finish = "length" if done.truncated else "tool_calls" if self._called else "stop"
        finish_chunk: dict[str, object] = self._chunk({}, finish)
        last = finish_chunk
        if self.request.include_usage:
            usage: dict[str, object] = {
                "prompt_tokens": self.request.prompt_tokens,
                "completion_tokens": done.output_tokens,
                "total_tokens": self.request.prompt_tokens + done.output_tokens,
            }
            if self.timings is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.timings.get("cache_n")}
            last = {**self._base, "choices": [], "usage": usage}
        if self.timings is not None:
            # As llama-server sends them: on the last chunk before [DONE].
            last["timings"] = {**self.timings, "predicted_n": done.output_tokens}
        out = self._event(dumps(finish_chunk))
        if last is not finish_chunk:
            out += self._event(dumps(last))
        return out + self._event(b"[DONE]")


class OpenAI(WireProtocol):
    name = "openai"
    # Every chunk stream ends its choice with a finish_reason before [DONE]; a server that
    # stops early (llama-cpp-python, when another request waits) sends [DONE] without one.
    finish_required = True
    # transformers serve (5.x) ends with its finish chunk (usage in it) and the chunked
    # terminator, and no [DONE].
    ends_with_body = True
    text_is = "chat chunks' choices[].delta.content (from /v1/completions: choices[].text)"

    def path(self, model: str) -> str:
        return "/v1/chat/completions"

    def routes(self) -> tuple[Route, ...]:
        # Legacy completions: the same protocol (one reader reads both), its own endpoint.
        return Route("/v1/chat/completions"), Route("/v1/completions", speaks=COMPLETIONS)

    def body_for(self, path: str, model: str, prompt: str, max_tokens: int) -> JsonDict:
        if is_legacy_path(path):
            return COMPLETIONS.body(model, prompt, max_tokens)
        return self.body(model, prompt, max_tokens)

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        # ``max_tokens`` rather than ``max_completion_tokens``: OpenAI still accepts it for chat
        # models, and vLLM, TGI and older OpenAI-compatible servers know only this one.
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def force_streaming(self, model: str, body: JsonDict) -> JsonDict:
        body.setdefault("model", model)
        body["stream"] = True
        # Without usage the output token count falls back to counting content events.
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                  "include_usage": True}
        return body

    def decode(self, event: Event) -> Decoded:
        # The per-event path of the load generator: one pass, exact type checks (a JSON
        # parser makes only these types), no list for the text of the usual one choice.
        data = event.data
        if data == "[DONE]" or data.strip() == "[DONE]":
            return Decoded(done=True)
        try:
            obj = orjson.loads(data)        # json_object's reader, without its call
        except ValueError:
            obj = json_object(event)        # raises, saying why
        if type(obj) is not dict:
            raise not_an_object(event)
        if "error" in obj:
            return Decoded(error=error_text(obj["error"]))
        text = reasoning = ""
        tools: tuple[ToolDelta, ...] = ()
        finish: str | None = None
        choices = obj.get("choices")
        if type(choices) is not list:
            if "choices" in obj or "usage" not in obj:
                # A usage-only chunk may leave choices out; any other chunk without a list of
                # them is not a chat completion chunk, whatever else it holds.
                raise ProtocolError(f"a chunk whose `choices` is {shape(choices)}, not a list: "
                                    f"{short(data)!r}")
            choices = ()
        for choice in choices:
            delta = choice.get("delta") if type(choice) is dict else None
            if delta is not None:
                if type(delta) is not dict:
                    raise _bad_choice(data)
                piece = delta.get("content")
                if type(piece) is str and piece:
                    text += piece
                piece = delta.get("reasoning_content") or delta.get("reasoning")
                if type(piece) is str and piece:
                    reasoning += piece
                calls = delta.get("tool_calls")
                if calls is not None:
                    tools += _tool_deltas(calls, choice.get("index", 0), data)
            elif type(choice) is not dict:
                raise _bad_choice(data)
            else:
                # Legacy completions: no delta, the choice's own text is the new text.
                piece = choice.get("text")
                if type(piece) is str and piece:
                    text += piece
            reason = choice.get("finish_reason")
            if reason is not None:
                finish = str(reason)
        usage = obj.get("usage")
        tokens = thought = None
        if type(usage) is dict:
            tokens = int_or_none(usage.get("completion_tokens"))
            details = usage.get("completion_tokens_details")
            if type(details) is dict:
                thought = int_or_none(details.get("reasoning_tokens"))
        rid, model = obj.get("id"), obj.get("model")
        cached, read = prompt_timings(obj) if "timings" in obj else (None, None)
        return Decoded(text, tokens, False, None, rid if type(rid) is str else None, finish,
                       model if type(model) is str else None, reasoning, tools, thought,
                       cached, read)

    def plain_text(self, data: bytes) -> tuple[str | None, str | None, str] | None:
        # ``decode``'s checks for a chat chunk of one choice whose delta is answer text and
        # nothing else; anything it does not vouch for is decode's to read.
        try:
            obj = orjson.loads(data)
        except ValueError:
            return None         # not JSON (or "[DONE]"), or not UTF-8
        if type(obj) is not dict or "error" in obj or "timings" in obj \
                or obj.get("usage") is not None:
            return None
        choices = obj.get("choices")
        if type(choices) is not list or len(choices) != 1:
            return None
        choice = choices[0]
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return None
        delta = choice.get("delta")
        if type(delta) is not dict or delta.get("tool_calls") is not None \
                or delta.get("reasoning_content") or delta.get("reasoning"):
            return None
        text = delta.get("content")
        if type(text) is not str or not text:
            return None
        rid, model = obj.get("id"), obj.get("model")
        return rid if type(rid) is str else None, model if type(model) is str else None, text

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        model_name = req.required_str(obj, "model")
        prompt = req.messages_text(obj)
        req.require_stream(obj)
        cap = req.optional_positive_int(obj, "max_completion_tokens")
        if cap is None:
            cap = req.optional_positive_int(obj, "max_tokens")
        options = obj.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        return GenRequest(
            model=model_name,
            prompt_tokens=req.count_tokens(prompt),
            prompt=prompt,
            max_tokens=cap,
            include_usage=options.get("include_usage") is True,
        )

    def error_body(self, status: int, message: str) -> JsonDict:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return OpenAIEncoder(request, ids)

    def is_content_event(self, event: Event) -> bool:
        obj = object_or_none(event)   # None for [DONE] too
        if obj is None or "error" in obj:
            return False
        choices = obj.get("choices")
        text = False
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            # The last chunk may carry text and the finish reason (vLLM adds stop_reason):
            # losing it loses the ending, so it is not content.
            if choice.get("finish_reason") is not None or choice.get("stop_reason") is not None:
                return False
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text |= any(nonempty_str(delta.get(k)) for k in _CONTENT_KEYS)
                # A tool call's argument delta is generated text; the one that opens the call
                # (its id and name) is not: losing it would orphan the arguments.
                calls = delta.get("tool_calls")
                for call in calls if isinstance(calls, list) else ():
                    fn = call.get("function") if isinstance(call, dict) else None
                    text |= isinstance(fn, dict) and nonempty_str(fn.get("arguments")) \
                        and fn.get("name") is None
            elif delta is None:     # legacy completions
                text |= nonempty_str(choice.get("text"))
        return text


def is_legacy_path(path: str) -> bool:
    """``path`` is legacy completions' (``/v1/completions``), not chat's."""
    route = path.split("?", 1)[0].rstrip("/")
    return route.endswith("/completions") and not route.endswith("/chat/completions")


class CompletionsEncoder(OpenAIEncoder):
    """Legacy completions' chunks: ``text_completion`` objects whose choice holds ``text``."""

    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self.response_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self._base = {**self._base, "id": self.response_id, "object": "text_completion"}
        self._head, self._tail = split(self._chunk({"text": TOKEN_MARK}, None))
        self._first = False          # no role chunk: a completion has no roles

    # A completion has neither reasoning nor tool calls: they go as text.
    def reasoning(self, text_json: bytes) -> bytes:
        return self.token(text_json)

    def tool_args(self, piece_json: bytes, first: bool, last: bool) -> bytes:
        return self.token(piece_json)

    def _chunk(self, delta: dict[str, object], finish: str | None) -> dict[str, object]:
        # The chat encoder's templates hold the token in delta.content: here it is the text.
        text = delta.get("text", delta.get("content", ""))
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return {**self._base, "choices": [choice]}


class OpenAICompletions(OpenAI):
    """Legacy completions (``POST /v1/completions``): the same protocol (``openai``: one reader
    reads both streams), another endpoint with its own request and chunks. Not registered on
    its own; the embedded target serves it beside chat, and ``OpenAI.body_for`` asks it when
    the scenario's ``target.path`` is its path."""

    def path(self, model: str) -> str:
        return "/v1/completions"

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        model_name = req.required_str(obj, "model")
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            prompt = " ".join(str(p) for p in prompt)
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' is required and must be a string or a list of strings")
        req.require_stream(obj)
        options = obj.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        return GenRequest(
            model=model_name,
            prompt_tokens=req.count_tokens(prompt),
            prompt=prompt,
            max_tokens=req.optional_positive_int(obj, "max_tokens"),
            include_usage=options.get("include_usage") is True,
        )

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return CompletionsEncoder(request, ids)


PROTOCOL = OpenAI()
COMPLETIONS = OpenAICompletions()
