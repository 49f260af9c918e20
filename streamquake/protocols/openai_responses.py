"""OpenAI's Responses API (``POST /v1/responses``, ``"stream": true``).

Typed events, each with an ``event:`` line naming its ``type``: ``response.created`` and
``response.in_progress`` (the response's id and model), the output item and content part opening,
``response.output_text.delta`` per piece of text, their ``.done`` closings, and one terminal
event: ``response.completed`` (``response.usage.output_tokens``), ``response.incomplete`` (cut by
``max_output_tokens`` or a content filter: ``response.incomplete_details.reason``, an answer
all the same, as chat's ``finish_reason: length`` is) or ``response.failed``
(``response.error``). An ``error`` event can come at any time. There is no ``[DONE]``.
"""

from __future__ import annotations

import json
import time
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
    split,
)
from streamquake.protocols.base import (
    BadRequest,
    Completion,
    Decoded,
    Event,
    GenRequest,
    Route,
    StreamEncoder,
    ToolDelta,
    WireProtocol,
    sse_event,
)

# Deltas of the answer's text, and of the reasoning the model streams before it (reasoning
# text from open models, summaries from OpenAI's own), each counted apart.
_TEXT_DELTA = "response.output_text.delta"
_REASONING_DELTAS = frozenset({"response.reasoning_text.delta",
                               "response.reasoning_summary_text.delta"})
_ARGS_DELTA = "response.function_call_arguments.delta"
# The events that end a response, each with the whole response object.
_COMPLETED, _INCOMPLETE, _FAILED = "response.completed", "response.incomplete", "response.failed"
_NOTHING = Decoded()


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


class ResponsesEncoder(StreamEncoder):
    """Output items one after the other: reasoning, then a message or a function call."""

    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self.response_id = f"resp_{uuid.uuid4().hex[:24]}"
        self._created = int(time.time())
        self._sequence = -1     # sequence_number, from 0 (not the SSE ids' counter)
        self._texts: list[bytes] = []       # the open item's pieces, as JSON strings
        self._index = 0
        self._kind = ""         # the open item: "reasoning", "message", "function_call"
        self._item = ""
        self._done: list[object] = []       # items closed so far, for the final response
        self._head = self._tail = self._name = b""
        self._reasoning_n = 0

    def _number(self) -> int:
        self._sequence += 1
        return self._sequence

    def _typed(self, obj: dict[str, object]) -> bytes:
        kind = str(obj["type"])
        return self._event(dumps({**obj, "sequence_number": self._number()}), kind.encode())

    def _response(self, status: str, output: list[object],
                  usage: dict[str, object] | None, **extra: object) -> dict[str, object]:
        return {"id": self.response_id, "object": "response", "created_at": self._created,
                "status": status, "error": None, "incomplete_details": None,
                "model": self.request.model, "output": output,
                "max_output_tokens": self.request.max_tokens, "usage": usage, **extra}

    def _message(self, status: str, text: str | None) -> dict[str, object]:
        content = [] if text is None else [{"type": "output_text", "annotations": [],
                                            "text": text}]
        return {"id": self._item, "type": "message", "status": status, "role": "assistant",
                "content": content}

    def _whole(self, status: str, text: str | None) -> dict[str, object]:
        """The open item, as its ``added`` (``text`` None) and ``done`` events give it."""
        if self._kind == "reasoning":
            content = [] if text is None else [{"type": "reasoning_text", "text": text}]
            return {"id": self._item, "type": "reasoning", "summary": [], "content": content}
        if self._kind == "function_call":
            return {"id": self._item, "type": "function_call", "status": status,
                    "call_id": f"call_{self._item[-24:]}", "name": self.tool_name or "tool",
                    "arguments": text or ""}
        return self._message(status, text)

    def _open(self, kind: str) -> bytes:
        """Start an output item of ``kind`` (closing the open one), and its delta template."""
        if kind == self._kind:
            return b""
        out = self._close("completed") if self._kind else b""
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self._kind, self._item = kind, f"{prefix}_{uuid.uuid4().hex[:24]}"
        out += self._typed({"type": "response.output_item.added", "output_index": self._index,
                            "item": self._whole("in_progress", None)})
        delta: dict[str, object] = {"item_id": self._item, "output_index": self._index}
        if kind == "message":
            out += self._typed({"type": "response.content_part.added", "item_id": self._item,
                                "output_index": self._index, "content_index": 0,
                                "part": {"type": "output_text", "annotations": [],
                                         "text": ""}})
            delta = {"type": _TEXT_DELTA, **delta, "content_index": 0, "delta": TOKEN_MARK,
                     "logprobs": []}
        elif kind == "reasoning":
            delta = {"type": "response.reasoning_text.delta", **delta, "content_index": 0,
                     "delta": TOKEN_MARK}
        else:
            delta = {"type": _ARGS_DELTA, **delta, "delta": TOKEN_MARK}
        head, tail = split({**delta, "sequence_number": 0})
        self._head, self._tail = head, tail.removesuffix(b"0}")
        self._name = str(delta["type"]).encode()
        return out

    def _joined(self) -> str:
        # Each piece is a JSON string literal: their insides joined are the whole text's.
        text: str = json.loads(b'"' + b"".join(t[1:-1] for t in self._texts) + b'"')
        return text

    def _close(self, status: str) -> bytes:
        text = self._joined()
        self._texts = []
        at = {"item_id": self._item, "output_index": self._index}
        if self._kind == "message":
            part = {"type": "output_text", "annotations": [], "text": text}
            out = (self._typed({"type": "response.output_text.done", **at, "content_index": 0,
                                "text": text, "logprobs": []})
                   + self._typed({"type": "response.content_part.done", **at,
                                  "content_index": 0, "part": part}))
        elif self._kind == "reasoning":
            out = self._typed({"type": "response.reasoning_text.done", **at, "content_index": 0,
                               "text": text})
        else:
            out = self._typed({"type": "response.function_call_arguments.done", **at,
                               "arguments": text})
        item = self._whole(status, text)
        self._done.append(item)
        self._index += 1
        return out + self._typed({"type": "response.output_item.done",
                                  "output_index": self._index - 1, "item": item})

    def opening(self) -> bytes:
        started = self._response("in_progress", [], None)
        first = "reasoning" if self.reasoning_first else \
            "function_call" if self.tool_name is not None else "message"
        return (self._typed({"type": "response.created", "response": started})
                + self._typed({"type": "response.in_progress", "response": started})
                + self._open(first))

    def _delta(self, kind: str, text_json: bytes) -> bytes:
        out = self._open(kind) if kind != self._kind else b""
        self._texts.append(text_json)
        return out + self._event(self._head + text_json + self._tail + b"%d}" % self._number(),
                                 self._name)

    def token(self, text_json: bytes) -> bytes:
        return self._delta("message", text_json)

    def reasoning(self, text_json: bytes) -> bytes:
        self._reasoning_n += 1
        return self._delta("reasoning", text_json)

    def tool_args(self, piece_json: bytes, first: bool, last: bool) -> bytes:
        return self._delta("function_call", piece_json)

    def closing(self, done: Completion) -> bytes:
        status = "incomplete" if done.truncated else "completed"
        out = self._close(status)
        usage = {"input_tokens": self.request.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": done.output_tokens,
                 "output_tokens_details": {"reasoning_tokens": self._reasoning_n},
                 "total_tokens": self.request.prompt_tokens + done.output_tokens}
        details = {"reason": "max_output_tokens"} if done.truncated else None
        final = self._response(status, self._done, usage)
        final["incomplete_details"] = details
        return out + self._typed({"type": _INCOMPLETE if done.truncated else _COMPLETED,
                                  "response": final})


class OpenAIResponses(WireProtocol):
    name = "openai_responses"
    # The terminal event says how the response ended (completed, incomplete and why); a
    # ``[DONE]`` that some compatible servers add is an end only after one of them.
    finish_required = True
    text_is = "response.output_text.delta events' `delta`, ended by response.completed"

    def path(self, model: str) -> str:
        return "/v1/responses"

    def routes(self) -> tuple[Route, ...]:
        return (Route("/v1/responses"),)

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        return {"model": model, "input": prompt, "max_output_tokens": max_tokens,
                "stream": True}

    def force_streaming(self, model: str, body: JsonDict) -> JsonDict:
        body.setdefault("model", model)
        body["stream"] = True
        return body

    def decode(self, event: Event) -> Decoded:
        data = event.data
        if data.strip() == "[DONE]":
            return Decoded(done=True)
        obj = json_object(event)
        kind = obj.get("type") or event.event
        if kind == _TEXT_DELTA:
            piece = obj.get("delta")
            return Decoded(text=piece) if isinstance(piece, str) else _NOTHING
        if kind in _REASONING_DELTAS:
            piece = obj.get("delta")
            return Decoded(reasoning=piece) if isinstance(piece, str) else _NOTHING
        if kind == _ARGS_DELTA:
            piece = obj.get("delta")
            return Decoded(tools=(ToolDelta(str(obj.get("item_id")), piece),)) \
                if isinstance(piece, str) else _NOTHING
        if kind == "response.output_item.added":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                args = item.get("arguments")
                return Decoded(tools=(ToolDelta(str(item.get("id")),
                                                args if isinstance(args, str) else "",
                                                _str(item.get("name"))),))
            return _NOTHING
        if kind in (_COMPLETED, _INCOMPLETE, _FAILED, "response.created",
                    "response.in_progress"):
            return self._response_event(str(kind), obj.get("response"))
        if kind == "error" or event.event == "error":
            # {"type": "error", "code", "message", "param"}; some servers nest an `error` object.
            err = obj.get("error")
            return Decoded(error=error_text(err if isinstance(err, dict) else
                                            {"code": obj.get("code"),
                                             "message": obj.get("message")}))
        return _NOTHING     # items and parts opening and closing, and types added later

    @staticmethod
    def _response_event(kind: str, response: object) -> Decoded:
        r = response if isinstance(response, dict) else {}
        usage = r.get("usage")
        tokens = thought = None
        if isinstance(usage, dict):
            tokens = int_or_none(usage.get("output_tokens"))
            details = usage.get("output_tokens_details")
            if isinstance(details, dict):
                thought = int_or_none(details.get("reasoning_tokens"))
        rid, model = _str(r.get("id")), _str(r.get("model"))
        if kind == _FAILED:
            err = r.get("error")
            return Decoded(error=error_text(err) if err else "response.failed (no error given)",
                           response_id=rid, model=model)
        finish: str | None = None
        if kind == _COMPLETED:
            finish = _str(r.get("status")) or "completed"
        elif kind == _INCOMPLETE:
            details = r.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, dict) else None
            finish = str(reason) if reason else "incomplete"
        return Decoded(usage_output_tokens=tokens, done=finish is not None, response_id=rid,
                       finish=finish, model=model, usage_reasoning_tokens=thought)

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        model_name = req.required_str(obj, "model")
        given = obj.get("input")
        if isinstance(given, str):
            prompt = given
        elif isinstance(given, list) and given:
            texts = []
            for i, item in enumerate(given):
                if not isinstance(item, dict):
                    raise BadRequest(f"input[{i}] must be an object")
                texts.append(req.text_of_content(item.get("content", ""),
                                                 f"input[{i}].content"))
            prompt = " ".join(texts)
        else:
            raise BadRequest("'input' is required: a string or a non-empty list of messages")
        if "instructions" in obj and isinstance(obj["instructions"], str):
            prompt += " " + obj["instructions"]
        req.require_stream(obj)
        return GenRequest(model=model_name, prompt_tokens=req.count_tokens(prompt),
                          max_tokens=req.optional_positive_int(obj, "max_output_tokens"),
                          prompt=prompt)

    def error_event(self, message: str | None = None) -> bytes:
        # The response as it failed; its ``error`` says why. The stream ends after it.
        text = message or "The server had an error while processing your request."
        return sse_event({"type": _FAILED, "response": {
            "id": "resp_" + uuid.uuid4().hex, "object": "response", "status": "failed",
            "error": {"code": "server_error", "message": text}}}, _FAILED)

    def error_body(self, status: int, message: str) -> JsonDict:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return ResponsesEncoder(request, ids)

    def is_content_event(self, event: Event) -> bool:
        # Every delta of generated text (answer, reasoning, refusal, tool arguments): losing
        # one loses text only. The .done events repeat it whole, and response.completed holds
        # the whole output: they end parts of the answer, so they are never content.
        obj = object_or_none(event)
        if obj is None:
            return False
        kind = obj.get("type") or event.event
        return (isinstance(kind, str) and kind.startswith("response.")
                and kind.endswith(".delta") and nonempty_str(obj.get("delta")))


PROTOCOL = OpenAIResponses()
