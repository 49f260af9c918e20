"""Generic SSE, for home-grown servers (``POST /v1/stream``).

The request is ``{"prompt": ..., "max_tokens": ...}``; each event is ``{"text": ...}`` and the
last ``{"done": true, "usage": {"output_tokens": N}}``. ``data: [DONE]`` is accepted as an end
too, since many such servers copy it from OpenAI.
"""

from __future__ import annotations

from streamquake.jsontypes import JsonDict
from streamquake.protocols import _requests as req
from streamquake.protocols._json import (
    dumps,
    error_text,
    int_or_none,
    json_object,
    nonempty_str,
    object_or_none,
)
from streamquake.protocols.base import (
    BadRequest,
    Completion,
    Decoded,
    Event,
    GenRequest,
    Route,
    StreamEncoder,
    WireProtocol,
)


class GenericEncoder(StreamEncoder):
    def token(self, text_json: bytes) -> bytes:
        return self._event(b'{"text":' + text_json + b"}")

    def closing(self, done: Completion) -> bytes:
        usage = {"output_tokens": done.output_tokens}
        return self._event(dumps({"done": True, "usage": usage}))


class GenericSSE(WireProtocol):
    name = "sse"
    text_is = 'events {"text": "..."}, the last {"done": true}'

    def path(self, model: str) -> str:
        return "/v1/stream"

    def routes(self) -> tuple[Route, ...]:
        return (Route("/v1/stream"),)

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        return {"prompt": prompt, "max_tokens": max_tokens}

    def decode(self, event: Event) -> Decoded:
        if event.data.strip() == "[DONE]":
            return Decoded(done=True)
        obj = json_object(event)
        if "error" in obj:
            return Decoded(error=error_text(obj["error"]))
        text = obj.get("text")
        usage = obj.get("usage")
        return Decoded(
            text=text if isinstance(text, str) else "",
            usage_output_tokens=int_or_none(usage.get("output_tokens"))
            if isinstance(usage, dict) else None,
            done=obj.get("done") is True,
            response_id=rid if isinstance(rid := obj.get("id"), str) else None,
        )

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' is required and must be a string")
        return GenRequest(
            model="sse",
            prompt_tokens=req.count_tokens(prompt),
            prompt=prompt,
            max_tokens=req.optional_positive_int(obj, "max_tokens"),
        )

    def error_body(self, status: int, message: str) -> JsonDict:
        return {"error": {"code": status, "message": message}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return GenericEncoder(request, ids)

    def is_content_event(self, event: Event) -> bool:
        # Stricter than the proxy's sniffing on one point: {"text": ..., "done": true} also
        # ends the stream, so it is not content (sniffing does not know "done" as a key).
        obj = object_or_none(event)
        if obj is None or "error" in obj:
            return False
        return nonempty_str(obj.get("text")) and obj.get("done") is not True


PROTOCOL = GenericSSE()
