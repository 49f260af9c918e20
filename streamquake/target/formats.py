"""Wire formats of the simulated endpoints: request parsing, error shapes and SSE event encoders.

Each protocol is one small class. Encoders build every event from byte templates prepared once
per response, because the per-token path is what bounds how many events/s one core can serve.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from streamquake.target.config import Protocol

# Short words a simulated model emits, one per event, each followed by a space.
VOCABULARY: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then",
    "streams", "tokens", "to", "every", "client", "that", "waits", "for", "its", "answer",
    "while", "faults", "shake", "network", "under", "load", "in", "real", "time", "again", "now",
)


class BadRequest(ValueError):
    """The request body is not what this endpoint accepts; answered 400 with the message."""


@dataclass(frozen=True)
class GenRequest:
    """What the simulator needs from a request, whatever its protocol."""

    model: str
    prompt_tokens: int
    max_tokens: int | None
    include_usage: bool = False


@dataclass(frozen=True)
class Completion:
    """How a stream ended: tokens sent and whether the request's max tokens cut it short."""

    output_tokens: int
    truncated: bool


def count_tokens(text: str) -> int:
    # A whitespace word count is close enough for usage figures; no tokenizer is simulated.
    return len(text.split())


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _split(template: dict[str, Any], marker: str = "\x00TOKEN\x00") -> tuple[bytes, bytes]:
    """Encode ``template`` once and cut it where the token's JSON string goes."""
    raw = _dumps(template)
    head, tail = raw.split(_dumps(marker), 1)
    return head, tail


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _optional_positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer, got {value!r}")
    return value


def _required_str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{key}' is required and must be a non-empty string")
    return value


def _require_stream(body: dict[str, Any]) -> None:
    if body.get("stream") is not True:
        raise BadRequest("this target only simulates streaming: set \"stream\": true")


def _text_of_content(content: object, where: str) -> str:
    """Text of an OpenAI/Anthropic ``content``: a string or a list of typed blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [b.get("text", "") for b in content if isinstance(b, dict)]
        return " ".join(t for t in texts if isinstance(t, str))
    raise BadRequest(f"{where} must be a string or a list of content blocks")


def _messages_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list")
    texts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object")
        texts.append(_text_of_content(msg.get("content", ""), f"messages[{i}].content"))
    return " ".join(texts)


class StreamEncoder(ABC):
    """Frames one response's events; every event carries ``id: N`` (1-based) when ids are on."""

    _eol: ClassVar[bytes] = b"\n"

    def __init__(self, request: GenRequest, ids: bool) -> None:
        self.request = request
        self._ids = ids
        self._seq = 0

    def _event(self, data: bytes, event: bytes | None = None) -> bytes:
        eol = self._eol
        head = b"" if event is None else b"event: " + event + eol
        if self._ids:
            self._seq += 1
            head = b"id: %d%s%s" % (self._seq, eol, head)
        return b"%sdata: %s%s%s" % (head, data, eol, eol)

    def opening(self) -> bytes:
        """Events sent once generation is admitted, before the first token."""
        return b""

    @abstractmethod
    def token(self, text_json: bytes) -> bytes:
        """One content event; ``text_json`` is the token already encoded as a JSON string."""

    @abstractmethod
    def closing(self, done: Completion) -> bytes:
        """Events that end the stream."""


class WireFormat(ABC):
    """One protocol: how its requests look, how its errors look, how its stream is framed."""

    name: ClassVar[Protocol]

    @abstractmethod
    def parse(self, body: object, model: str | None) -> GenRequest:
        """Validate a request body; ``model`` comes from the URL where the protocol puts it."""

    @abstractmethod
    def error_body(self, status: int, message: str) -> dict[str, Any]:
        """The protocol's own JSON error shape."""

    @abstractmethod
    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        """A fresh encoder for one response."""


# --- OpenAI chat completions -------------------------------------------------------------------


class OpenAIEncoder(StreamEncoder):
    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self._base = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": request.model,
            "system_fingerprint": "fp_streamquake",
        }
        self._head, self._tail = _split(self._chunk({"content": "\x00TOKEN\x00"}, None))
        self._first = True

    def _chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._base, "choices": [choice]}

    def token(self, text_json: bytes) -> bytes:
        out = b""
        if self._first:
            # Like the real API, the role chunk arrives with the first token, not before it.
            self._first = False
            out = self._event(_dumps(self._chunk({"role": "assistant", "content": ""}, None)))
        return out + self._event(self._head + text_json + self._tail)

    def closing(self, done: Completion) -> bytes:
        out = self._event(_dumps(self._chunk({}, "length" if done.truncated else "stop")))
        if self.request.include_usage:
            usage = {
                "prompt_tokens": self.request.prompt_tokens,
                "completion_tokens": done.output_tokens,
                "total_tokens": self.request.prompt_tokens + done.output_tokens,
            }
            out += self._event(_dumps({**self._base, "choices": [], "usage": usage}))
        return out + self._event(b"[DONE]")


class OpenAIFormat(WireFormat):
    name = "openai"

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = _require_object(body)
        model_name = _required_str(obj, "model")
        prompt = _messages_text(obj)
        _require_stream(obj)
        cap = _optional_positive_int(obj, "max_completion_tokens")
        if cap is None:
            cap = _optional_positive_int(obj, "max_tokens")
        options = obj.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        return GenRequest(
            model=model_name,
            prompt_tokens=count_tokens(prompt),
            max_tokens=cap,
            include_usage=options.get("include_usage") is True,
        )

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return OpenAIEncoder(request, ids)


# --- Anthropic messages ------------------------------------------------------------------------


class AnthropicEncoder(StreamEncoder):
    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self._id = f"msg_{uuid.uuid4().hex[:24]}"
        self._head, self._tail = _split(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "\x00TOKEN\x00"},
            }
        )

    def opening(self) -> bytes:
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.request.prompt_tokens, "output_tokens": 1},
        }
        block = {"type": "text", "text": ""}
        return (
            self._event(_dumps({"type": "message_start", "message": message}), b"message_start")
            + self._event(
                _dumps({"type": "content_block_start", "index": 0, "content_block": block}),
                b"content_block_start",
            )
            + self._event(b'{"type":"ping"}', b"ping")
        )

    def token(self, text_json: bytes) -> bytes:
        return self._event(self._head + text_json + self._tail, b"content_block_delta")

    def closing(self, done: Completion) -> bytes:
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": "max_tokens" if done.truncated else "end_turn",
                "stop_sequence": None,
            },
            "usage": {"output_tokens": done.output_tokens},
        }
        return (
            self._event(b'{"type":"content_block_stop","index":0}', b"content_block_stop")
            + self._event(_dumps(delta), b"message_delta")
            + self._event(b'{"type":"message_stop"}', b"message_stop")
        )


class AnthropicFormat(WireFormat):
    name = "anthropic"

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = _require_object(body)
        model_name = _required_str(obj, "model")
        prompt = _messages_text(obj)
        if "system" in obj:
            prompt += " " + _text_of_content(obj["system"], "'system'")
        cap = _optional_positive_int(obj, "max_tokens")
        if cap is None:
            raise BadRequest("'max_tokens' is required")
        _require_stream(obj)
        return GenRequest(model=model_name, prompt_tokens=count_tokens(prompt), max_tokens=cap)

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return AnthropicEncoder(request, ids)


# --- Gemini streamGenerateContent ----------------------------------------------------------------


class GeminiEncoder(StreamEncoder):
    _eol = b"\r\n"

    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self._response_id = uuid.uuid4().hex[:22]
        self._head, self._tail = _split(self._chunk("\x00TOKEN\x00", None))

    def _chunk(self, text: str, finish: Completion | None) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}}
        usage: dict[str, Any] = {"promptTokenCount": self.request.prompt_tokens}
        if finish is not None:
            candidate["finishReason"] = "MAX_TOKENS" if finish.truncated else "STOP"
            usage["candidatesTokenCount"] = finish.output_tokens
            usage["totalTokenCount"] = self.request.prompt_tokens + finish.output_tokens
        else:
            usage["totalTokenCount"] = self.request.prompt_tokens
        candidate["index"] = 0
        return {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": self.request.model,
            "responseId": self._response_id,
        }

    def token(self, text_json: bytes) -> bytes:
        return self._event(self._head + text_json + self._tail)

    def closing(self, done: Completion) -> bytes:
        return self._event(_dumps(self._chunk("", done)))


def _gemini_text(obj: dict[str, Any]) -> str:
    contents = obj.get("contents")
    if not isinstance(contents, list) or not contents:
        raise BadRequest("'contents' is required and must be a non-empty list")
    texts: list[str] = []
    for i, content in enumerate(contents):
        parts = content.get("parts") if isinstance(content, dict) else None
        if not isinstance(parts, list):
            raise BadRequest(f"contents[{i}].parts must be a list")
        texts.extend(p.get("text", "") for p in parts if isinstance(p, dict))
    system = obj.get("systemInstruction")
    if isinstance(system, dict) and isinstance(system.get("parts"), list):
        texts.extend(p.get("text", "") for p in system["parts"] if isinstance(p, dict))
    return " ".join(t for t in texts if isinstance(t, str))


class GeminiFormat(WireFormat):
    name = "gemini"

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = _require_object(body)
        prompt = _gemini_text(obj)
        config = obj.get("generationConfig") or {}
        if not isinstance(config, dict):
            raise BadRequest("'generationConfig' must be an object")
        return GenRequest(
            model=model or "gemini",
            prompt_tokens=count_tokens(prompt),
            max_tokens=_optional_positive_int(config, "maxOutputTokens"),
        )

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        state = "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"
        if status == 404:
            state = "NOT_FOUND"
        return {"error": {"code": status, "message": message, "status": state}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return GeminiEncoder(request, ids)


# --- Generic SSE -------------------------------------------------------------------------------


class GenericEncoder(StreamEncoder):
    def token(self, text_json: bytes) -> bytes:
        return self._event(b'{"text":' + text_json + b"}")

    def closing(self, done: Completion) -> bytes:
        usage = {"output_tokens": done.output_tokens}
        return self._event(_dumps({"done": True, "usage": usage}))


class GenericFormat(WireFormat):
    name = "sse"

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = _require_object(body)
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' is required and must be a string")
        return GenRequest(
            model="sse",
            prompt_tokens=count_tokens(prompt),
            max_tokens=_optional_positive_int(obj, "max_tokens"),
        )

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        return {"error": {"code": status, "message": message}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return GenericEncoder(request, ids)


FORMATS: dict[str, WireFormat] = {
    f.name: f for f in (OpenAIFormat(), AnthropicFormat(), GeminiFormat(), GenericFormat())
}

# Each word as its JSON string literal with the trailing space, encoded once at import.
TOKEN_JSON: tuple[bytes, ...] = tuple(_dumps(w + " ") for w in VOCABULARY)
