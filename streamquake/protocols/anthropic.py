"""Anthropic messages (``POST /v1/messages``, ``"stream": true``).

Named events: ``message_start``, then per content block ``content_block_start``, its
``content_block_delta`` events and ``content_block_stop``; ``message_delta`` (stop reason,
usage) and ``message_stop`` end the stream; ``ping`` and ``error`` may come at any time.
"""

from __future__ import annotations

import uuid

from streamquake.jsontypes import JsonDict
from streamquake.protocols import _requests as req
from streamquake.protocols._json import (
    TOKEN_MARK,
    dumps,
    error_text,
    int_or_none,
    json_object,
    nonempty_str,
    object_or_none,
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
    sse_event,
)

ANTHROPIC_VERSION = "2023-06-01"

# Deltas that carry generated content, and the key that holds it: answer text, thinking
# (reasoning), and a tool_use block's arguments (input_json_delta), each counted apart.
_CONTENT_KEYS = {"text_delta": "text", "thinking_delta": "thinking",
                 "input_json_delta": "partial_json"}
# The delta each kind of block streams, and the key that holds it.
_BLOCK_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
                 "tool_use": ("input_json_delta", "partial_json")}

_NOTHING = Decoded()


class AnthropicEncoder(StreamEncoder):
    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self.response_id = self._id = f"msg_{uuid.uuid4().hex[:24]}"
        self._index = 0
        self._kind = "text"
        self._called = False
        self._head, self._tail = self._template()

    def _template(self) -> tuple[bytes, bytes]:
        kind, key = _BLOCK_DELTAS[self._kind]
        return split({"type": "content_block_delta", "index": self._index,
                      "delta": {"type": kind, key: TOKEN_MARK}})

    def _block(self) -> dict[str, object]:
        if self._kind == "thinking":
            return {"type": "thinking", "thinking": ""}
        if self._kind == "tool_use":
            self._called = True
            return {"type": "tool_use", "id": f"toolu_{self._id[-24:]}",
                    "name": self.tool_name or "tool", "input": {}}
        return {"type": "text", "text": ""}

    def _start(self) -> bytes:
        return self._event(dumps({"type": "content_block_start", "index": self._index,
                                  "content_block": self._block()}), b"content_block_start")

    def _stop(self) -> bytes:
        out = b""
        if self._kind == "thinking":
            # As the real API closes a thinking block: its signature, then the stop.
            out = self._event(dumps({"type": "content_block_delta", "index": self._index,
                                     "delta": {"type": "signature_delta",
                                               "signature": "c3RyZWFtcXVha2U="}}),
                              b"content_block_delta")
        return out + self._event(b'{"type":"content_block_stop","index":%d}' % self._index,
                                 b"content_block_stop")

    def _switch(self, kind: str) -> bytes:
        """Close the open block and start one of ``kind``, when the answer changes kind."""
        if kind == self._kind:
            return b""
        out = self._stop()
        self._index += 1
        self._kind = kind
        self._head, self._tail = self._template()
        return out + self._start()

    def opening(self) -> bytes:
        message: dict[str, object] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.request.prompt_tokens, "output_tokens": 1},
        }
        # The first block is the answer's first part: thinking, a tool call, or text.
        self._kind = "thinking" if self.reasoning_first else \
            "tool_use" if self.tool_name is not None else "text"
        self._head, self._tail = self._template()
        return (
            self._event(dumps({"type": "message_start", "message": message}), b"message_start")
            + self._start()
            + self._event(b'{"type":"ping"}', b"ping")
        )

    def token(self, text_json: bytes) -> bytes:
        out = b"" if self._kind == "text" else self._switch("text")
        return out + self._event(self._head + text_json + self._tail, b"content_block_delta")

    def reasoning(self, text_json: bytes) -> bytes:
        return self._switch("thinking") + self._event(self._head + text_json + self._tail,
                                                      b"content_block_delta")

    def tool_args(self, piece_json: bytes, first: bool, last: bool) -> bytes:
        return self._switch("tool_use") + self._event(self._head + piece_json + self._tail,
                                                      b"content_block_delta")

    def closing(self, done: Completion) -> bytes:
        reason = "max_tokens" if done.truncated else "tool_use" if self._called else "end_turn"
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": None},
            "usage": {"output_tokens": done.output_tokens},
        }
        return (
            self._stop()
            + self._event(dumps(delta), b"message_delta")
            + self._event(b'{"type":"message_stop"}', b"message_stop")
        )


class Anthropic(WireProtocol):
    name = "anthropic"
    text_is = "content_block_delta events' delta.text, ended by message_stop"
    # message_delta carries the stop_reason before message_stop.
    finish_required = True

    def path(self, model: str) -> str:
        return "/v1/messages"

    def routes(self) -> tuple[Route, ...]:
        return (Route("/v1/messages"),)

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "anthropic-version": ANTHROPIC_VERSION}

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        return {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
        }

    def force_streaming(self, model: str, body: JsonDict) -> JsonDict:
        body.setdefault("model", model)
        body["stream"] = True
        return body

    def decode(self, event: Event) -> Decoded:
        obj = json_object(event)
        # The type is in the data; the event name is the fallback for servers that omit it.
        kind = obj.get("type") or event.event
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if not isinstance(delta, dict):
                raise ProtocolError(f"a content_block_delta whose `delta` is {shape(delta)}, "
                                    f"not an object: {short(event.data)!r}")
            sort = delta.get("type")
            if sort == "text_delta":
                piece = delta.get("text")
                return Decoded(text=piece) if isinstance(piece, str) else _NOTHING
            if sort == "thinking_delta":
                piece = delta.get("thinking")
                return Decoded(reasoning=piece) if isinstance(piece, str) else _NOTHING
            if sort == "input_json_delta":
                piece = delta.get("partial_json")
                if isinstance(piece, str):
                    return Decoded(tools=(ToolDelta(str(obj.get("index")), piece),))
            return _NOTHING     # signature_delta, citations, and types added later
        if kind == "message_delta":
            usage, delta = obj.get("usage"), obj.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            return Decoded(
                usage_output_tokens=int_or_none(usage.get("output_tokens"))
                if isinstance(usage, dict) else None,
                finish=str(reason) if reason is not None else None,
            )
        if kind == "message_stop":
            return Decoded(done=True)
        if kind == "error" or event.event == "error":
            return Decoded(error=error_text(obj.get("error", obj)))
        if kind == "content_block_start":
            block = obj.get("content_block")
            if not isinstance(block, dict):
                return _NOTHING
            if block.get("type") == "tool_use":
                # Opens the call (its arguments come as input_json_delta at this index).
                name = block.get("name")
                return Decoded(tools=(ToolDelta(str(obj.get("index")), "",
                                                name if isinstance(name, str) else None),))
            text, thinking = block.get("text"), block.get("thinking")
            return Decoded(text=text if isinstance(text, str) else "",
                           reasoning=thinking if isinstance(thinking, str) else "")
        if kind == "message_start":
            message = obj.get("message")
            if not isinstance(message, dict):
                raise ProtocolError(f"a message_start whose `message` is {shape(message)}, "
                                    f"not an object: {short(event.data)!r}")
            rid, model = message.get("id"), message.get("model")
            return Decoded(response_id=rid if isinstance(rid, str) else None,
                           model=model if isinstance(model, str) else None)
        return _NOTHING   # ping, content_block_stop, and types added later

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        model_name = req.required_str(obj, "model")
        prompt = req.messages_text(obj)
        if "system" in obj:
            prompt += " " + req.text_of_content(obj["system"], "'system'")
        cap = req.optional_positive_int(obj, "max_tokens")
        if cap is None:
            raise BadRequest("'max_tokens' is required")
        req.require_stream(obj)
        return GenRequest(model=model_name, prompt_tokens=req.count_tokens(prompt), max_tokens=cap,
                          prompt=prompt)

    def error_event(self, message: str | None = None) -> bytes:
        # What the Messages API sends when it is overloaded mid-stream; the stream then ends.
        return sse_event({"type": "error", "error": {"type": "overloaded_error",
                                                     "message": message or "Overloaded"}},
                         "error")

    def error_body(self, status: int, message: str) -> JsonDict:
        kind = "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return AnthropicEncoder(request, ids)

    def is_content_event(self, event: Event) -> bool:
        # Only deltas: a content_block_start that carries text also opens the block, and
        # losing it would leave the client's blocks out of step.
        obj = object_or_none(event)
        if obj is None or (obj.get("type") or event.event) != "content_block_delta":
            return False
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return False
        return nonempty_str(delta.get(_CONTENT_KEYS.get(str(delta.get("type")), "")))


PROTOCOL = Anthropic()
