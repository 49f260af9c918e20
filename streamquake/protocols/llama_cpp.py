"""llama.cpp's native completion (``POST /completion`` on ``llama-server``, ``"stream": true``).

The request is ``{"prompt": ..., "n_predict": N, "stream": true}``; each event is
``{"content": "<piece>", "stop": false, "tokens_predicted": ..., ...}`` and the last one
``{"content": "", "stop": true, "stop_type": "limit"|"eos"|"word", "tokens_predicted": N,
"timings": {...}, ...}``. No ``[DONE]`` and no response id. llama-server also speaks ``openai``
(``/v1/chat/completions``, ``/v1/completions``) and ``anthropic`` (``/v1/messages``).

A protocol of its own, not a mode of ``openai``: its request, its events and its end share
nothing with OpenAI's chunks, and the load generator picks its reader by protocol, not by path.
"""

from __future__ import annotations

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
    prompt_timings,
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
    WireProtocol,
)


class LlamaCppEncoder(StreamEncoder):
    def __init__(self, request: GenRequest, ids: bool) -> None:
        super().__init__(request, ids)
        self._n = 0
        head, tail = split({"index": 0, "content": TOKEN_MARK, "tokens": [], "stop": False,
                            "id_slot": 0, "tokens_predicted": 0,
                            "tokens_evaluated": request.prompt_tokens})
        self._head = head
        # The running count sits before tokens_evaluated: cut the template around its 0.
        before, after = tail.split(b'"tokens_predicted":0', 1)
        self._tail, self._end = before + b'"tokens_predicted":', after

    def token(self, text_json: bytes) -> bytes:
        self._n += 1
        return self._event(self._head + text_json + self._tail + b"%d" % self._n + self._end)

    def closing(self, done: Completion) -> bytes:
        prompt_n = self.request.prompt_tokens
        final = {
            "index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True,
            "model": self.request.model, "tokens_predicted": done.output_tokens,
            "tokens_evaluated": prompt_n,
            "generation_settings": {"n_predict": self.request.max_tokens or -1},
            "has_new_line": False, "truncated": False,
            "stop_type": "limit" if done.truncated else "eos", "stopping_word": "",
            "tokens_cached": prompt_n + done.output_tokens,
            "timings": {"prompt_n": prompt_n, **(self.timings or {}),
                        "predicted_n": done.output_tokens},
        }
        return self._event(dumps(final))


class LlamaCpp(WireProtocol):
    name = "llama_cpp"
    text_is = "events {\"content\": \"<text>\", \"stop\": false}, the last with \"stop\": true"

    def path(self, model: str) -> str:
        return "/completion"

    def routes(self) -> tuple[Route, ...]:
        # llama-server's native endpoint, and the older name it still answers to.
        return Route("/completion"), Route("/completions")

    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        # llama-server serves the model it loaded whatever a request names (and answers with
        # its alias); the name is there for servers that route by it.
        return {"model": model, "prompt": prompt, "n_predict": max_tokens, "stream": True}

    def force_streaming(self, model: str, body: JsonDict) -> JsonDict:
        body["stream"] = True
        return body

    def decode(self, event: Event) -> Decoded:
        obj = json_object(event)
        if "error" in obj:
            return Decoded(error=error_text(obj["error"]))
        if "content" not in obj and "stop" not in obj:
            raise ProtocolError("an event with neither `content` nor `stop`, not a llama.cpp "
                                f"completion event: {short(event.data)!r}")
        piece = obj.get("content")
        text = piece if isinstance(piece, str) else ""
        model = obj.get("model")
        if obj.get("stop") is not True:
            return Decoded(text=text)
        reason = obj.get("stop_type")
        cached, read = prompt_timings(obj)
        return Decoded(text=text, usage_output_tokens=int_or_none(obj.get("tokens_predicted")),
                       done=True, finish=str(reason) if reason else "stop",
                       model=model if isinstance(model, str) else None,
                       cache_n=cached, prompt_n=read)

    def parse(self, body: object, model: str | None) -> GenRequest:
        obj = req.require_object(body)
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            prompt = " ".join(str(p) for p in prompt)
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' is required and must be a string")
        n = obj.get("n_predict")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise BadRequest(f"'n_predict' must be an integer (-1: no limit), got {n!r}")
        req.require_stream(obj)
        name = obj.get("model")
        return GenRequest(model=name if isinstance(name, str) and name else "llama-cpp",
                          prompt_tokens=req.count_tokens(prompt), prompt=prompt,
                          max_tokens=n if n is not None and n > 0 else None)

    def error_body(self, status: int, message: str) -> JsonDict:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"code": status, "message": message, "type": kind}}

    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        return LlamaCppEncoder(request, ids)

    def is_content_event(self, event: Event) -> bool:
        # The stop event ends the stream: never content, even with text in it.
        obj = object_or_none(event)
        if obj is None or "error" in obj or obj.get("stop") is True:
            return False
        return nonempty_str(obj.get("content"))


PROTOCOL = LlamaCpp()
