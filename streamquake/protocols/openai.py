"""OpenAI chat completions (``POST /v1/chat/completions``, ``"stream": true``).

Also what vLLM, TGI, SGLang and most OpenAI-compatible servers speak. The stream is
``chat.completion.chunk`` objects, a finish chunk, an optional usage chunk and ``data: [DONE]``.
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
    StreamEncoder,
    WireProtocol,
)

# reasoning_content: the thinking that vLLM and DeepSeek stream before the answer.
_DECODED_KEYS = ("reasoning_content", "content")
# A refusal is generated text too; the client does not count it, but dropping it loses text only.
_CONTENT_KEYS = (*_DECODED_KEYS, "refusal")


def _bad_choice(data: str) -> ProtocolError:
    return ProtocolError("a chunk with a choice that is not an object with an object `delta`: "
                         f"{short(data)!r}")


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

    def _chunk(self, delta: dict[str, object], finish: str | None) -> dict[str, object]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._base, "choices": [choice]}

    def token(self, text_json: bytes) -> bytes:
        out = b""
        if self._first:
            # Like the real API, the role chunk arrives with the first token, not before it.
            self._first = False
            out = self._event(dumps(self._chunk({"role": "assistant", "content": ""}, None)))
        return out + self._event(self._head + text_json + self._tail)

    def closing(self, done: Completion) -> bytes:
        out = self._event(dumps(self._chunk({}, "length" if done.truncated else "stop")))
        if self.request.include_usage:
            usage = {
                "prompt_tokens": self.request.prompt_tokens,
                "completion_tokens": done.output_tokens,
                "total_tokens": self.request.prompt_tokens + done.output_tokens,
            }
            out += self._event(dumps({**self._base, "choices": [], "usage": usage}))
        return out + self._event(b"[DONE]")


class OpenAI(WireProtocol):
    name = "openai"
    # Every chunk stream ends its choice with a finish_reason before [DONE]; a server that
    # stops early (llama-cpp-python, when another request waits) sends [DONE] without one.
    finish_required = True

    def path(self, model: str) -> str:
        return "/v1/chat/completions"

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
        text = ""
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
                for key in _DECODED_KEYS:
                    piece = delta.get(key)
                    if type(piece) is str and piece:
                        text += piece
            elif type(choice) is not dict:
                raise _bad_choice(data)
            reason = choice.get("finish_reason")
            if reason is not None:
                finish = str(reason)
        usage = obj.get("usage")
        tokens = int_or_none(usage.get("completion_tokens")) if type(usage) is dict else None
        rid, model = obj.get("id"), obj.get("model")
        return Decoded(text, tokens, False, None, rid if type(rid) is str else None, finish,
                       model if type(model) is str else None)

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
            if isinstance(delta, dict) and any(nonempty_str(delta.get(k)) for k in _CONTENT_KEYS):
                text = True
        return text


PROTOCOL = OpenAI()
