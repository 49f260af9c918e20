"""Gemini ``streamGenerateContent?alt=sse`` (``POST /v1beta/models/{model}:...``).

Every event is a whole ``GenerateContentResponse``: candidates with text parts, and usage
metadata; the chunk with a ``finishReason`` is the last. No ``[DONE]``, and the model is in the
URL, not the body. Events end in CRLF, as Google's servers send them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

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


class GeminiEncoder(StreamEncoder):
    _eol = b"\r\n"

    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self.response_id = self._response_id = uuid.uuid4().hex[:22]
        self._head, self._tail = split(self._chunk(TOKEN_MARK, None))
        self._pieces: list[str] = []

    def _chunk(self, text: str, finish: Completion | None) -> dict[str, object]:
        candidate: dict[str, object] = {"content": {"parts": [{"text": text}], "role": "model"}}
        usage: dict[str, object] = {"promptTokenCount": self.request.prompt_tokens}
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

    def reasoning(self, text_json: bytes) -> bytes:
        # A thought part: text marked ``thought: true`` (includeThoughts).
        return self._event(self._head + text_json + b',"thought":true' + self._tail)

    def tool_args(self, piece_json: bytes, first: bool, last: bool) -> bytes:
        # Gemini sends a function call whole, in one part, once its arguments are complete: the
        # pieces wait here (a call cut short by the token limit is never sent).
        self._pieces.append(json.loads(piece_json))
        if not last:
            return b""
        call = {"name": self.tool_name or "tool", "args": json.loads("".join(self._pieces))}
        chunk = self._chunk("", None)
        chunk["candidates"][0]["content"]["parts"] = [{"functionCall": call}]  # type: ignore[index]
        return self._event(dumps(chunk))

    def closing(self, done: Completion) -> bytes:
        return self._event(dumps(self._chunk("", done)))


def _prompt_text(obj: Mapping[str, object]) -> str:
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


class Gemini(WireProtocol):
    name = "gemini"
    text_is = "chunks' candidates[].content.parts[].text, the last with a finishReason"
    # The reasons a candidate stops for a filter, not because the answer is done (the API's
    # FinishReason enum).
    safety_finishes = frozenset({"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT",
                                 "SPII", "IMAGE_SAFETY"})

    def path(self, model: str) -> str:
        return f"/v1beta/models/{model}:streamGenerateContent?alt=sse"

    def routes(self) -> tuple[Route, ...]:
        # google-genai calls /v1beta/ or /v1/ depending on its version and options.
        return (Route("/{version:v1beta|v1}/models/{target}"),)

    def url_model(self, params: Mapping[str, str], query: Mapping[str, str], path: str
                  ) -> str | None:
        model, _, method = params["target"].partition(":")
        if method == "generateContent":
            raise BadRequest(
                "this target only simulates streaming: call :streamGenerateContent?alt=sse")
        if method != "streamGenerateContent" or not model:
            raise BadRequest(f"unknown method {path!r}", 404)
        if query.get("alt") != "sse":
            raise BadRequest("this target only streams server-sent events: add ?alt=sse to the URL")
        return model

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        return {
            "contents": [{"role": "user", "parts": [{"text": prompt}]}],
            "generationConfig": {"maxOutputTokens": max_tokens},
        }

    def decode(self, event: Event) -> Decoded:
        obj = json_object(event)
        if "error" in obj:
            return Decoded(error=error_text(obj["error"]))
        texts: list[str] = []
        thoughts: list[str] = []
        tools: list[ToolDelta] = []
        finish: str | None = None
        candidates = obj.get("candidates")
        if not isinstance(candidates, list | None) or (
                candidates is None and not {"usageMetadata", "promptFeedback"} & obj.keys()):
            # Usage-only and prompt-feedback chunks may have no candidates; others must.
            raise ProtocolError(f"a chunk whose `candidates` is {shape(candidates)}, not a "
                                f"list: {short(event.data)!r}")
        for cand in candidates or ():
            content = cand.get("content") if isinstance(cand, dict) else None
            parts = content.get("parts") if isinstance(content, dict) else None
            if not isinstance(cand, dict) or not isinstance(content, dict | None) \
                    or not isinstance(parts, list | None):
                raise ProtocolError("a candidate that is not an object with `content.parts` a "
                                    f"list: {short(event.data)!r}")
            for part in parts or ():
                if not isinstance(part, dict):
                    continue
                text = part.get("text")
                if isinstance(text, str) and text:
                    (thoughts if part.get("thought") is True else texts).append(text)
                call = part.get("functionCall")
                if isinstance(call, dict):
                    # Whole, its arguments an object: a call with nothing left to close.
                    name, args = call.get("name"), call.get("args")
                    tools.append(ToolDelta("", json.dumps(args if args is not None else {}),
                                           name if isinstance(name, str) else None))
            reason = cand.get("finishReason")
            if reason and reason != "FINISH_REASON_UNSPECIFIED":
                finish = str(reason)
        feedback = obj.get("promptFeedback")
        if not texts and isinstance(feedback, dict) and feedback.get("blockReason"):
            return Decoded(done=True, error=f"prompt blocked: {feedback['blockReason']}")
        meta = obj.get("usageMetadata")
        tokens = thought = None
        if isinstance(meta, dict):
            tokens = int_or_none(meta.get("candidatesTokenCount"))
            # Thinking tokens are generated output too; Gemini counts them apart.
            thought = int_or_none(meta.get("thoughtsTokenCount"))
            if tokens is not None:
                tokens += thought or 0
        rid, model = obj.get("responseId"), obj.get("modelVersion")
        # The finish reason is Gemini's end of stream: it has no terminal event of its own.
        return Decoded(text="".join(texts), usage_output_tokens=tokens, done=finish is not None,
                       finish=finish, response_id=rid if isinstance(rid, str) else None,
                       model=model if isinstance(model, str) else None,
                       reasoning="".join(thoughts), tools=tuple(tools),
                       usage_reasoning_tokens=thought)

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        prompt = _prompt_text(obj)
        config = obj.get("generationConfig") or {}
        if not isinstance(config, dict):
            raise BadRequest("'generationConfig' must be an object")
        return GenRequest(
            model=model or "gemini",
            prompt_tokens=req.count_tokens(prompt),
            prompt=prompt,
            max_tokens=req.optional_positive_int(config, "maxOutputTokens"),
        )

    def error_event(self, message: str | None = None) -> bytes:
        # Gemini has no error event mid-stream: its safety filter stops the answer with a last
        # chunk whose candidate says SAFETY (no text, the ratings that blocked it).
        return sse_event({"candidates": [{
            "finishReason": "SAFETY", "index": 0,
            "safetyRatings": [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT",
                               "probability": "HIGH", "blocked": True}],
        }]})

    def error_body(self, status: int, message: str) -> JsonDict:
        state = "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"
        if status == 404:
            state = "NOT_FOUND"
        return {"error": {"code": status, "message": message, "status": state}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return GeminiEncoder(request, ids)

    def is_content_event(self, event: Event) -> bool:
        obj = object_or_none(event)
        if obj is None or "error" in obj:
            return False
        candidates = obj.get("candidates")
        text = False
        for cand in candidates if isinstance(candidates, list) else ():
            if not isinstance(cand, dict):
                continue
            # The last chunk often has text too, but it also ends the stream. Any finishReason
            # counts here, even FINISH_REASON_UNSPECIFIED: when in doubt, not content.
            if cand.get("finishReason") is not None:
                return False
            content = cand.get("content")
            parts = content.get("parts") if isinstance(content, dict) else None
            if isinstance(parts, list) and any(
                isinstance(p, dict) and (nonempty_str(p.get("text"))
                                         or isinstance(p.get("functionCall"), dict))
                for p in parts
            ):
                text = True
        return text


PROTOCOL = Gemini()
