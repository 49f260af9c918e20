"""The wire formats a load user speaks: how to ask for a stream, and what each event means.

Formats are those of the real APIs (Gemini ``streamGenerateContent?alt=sse``, OpenAI chat
completions, Anthropic messages) plus a generic one (``/v1/stream``, ``{"text": ...}`` events,
``{"done": true, "usage": ...}`` at the end) for home-grown servers.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamquake.errors import StreamquakeError
from streamquake.loadgen.plan import RequestClassPlan
from streamquake.loadgen.sse import SSEEvent
from streamquake.target.config import Protocol

ANTHROPIC_VERSION = "2023-06-01"
_DETAIL_MAX = 200


class ProtocolError(StreamquakeError):
    """An event's payload is not what the protocol says it should be (e.g. not JSON)."""


@dataclass(frozen=True, slots=True)
class Decoded:
    text: str = ""                          # generated text this event carries ("" if none)
    usage_output_tokens: int | None = None  # the server's count of output tokens so far
    done: bool = False                      # the protocol's terminal event
    error: str | None = None                # the server reported an error in the stream


_NOTHING = Decoded()


def default_path(protocol: Protocol, model: str) -> str:
    if protocol == "gemini":
        return f"/v1beta/models/{model}:streamGenerateContent?alt=sse"
    return {"openai": "/v1/chat/completions", "anthropic": "/v1/messages", "sse": "/v1/stream"}[
        protocol
    ]


def protocol_headers(protocol: Protocol) -> dict[str, str]:
    """Headers the protocol requires besides the user's own (keys, versions)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if protocol == "anthropic":
        headers["anthropic-version"] = ANTHROPIC_VERSION
    return headers


def build_request(
    protocol: Protocol, model: str, cls: RequestClassPlan, rng: random.Random
) -> tuple[str, dict[str, Any]]:
    """Path and JSON body of one streaming request of class ``cls``.

    A class's full ``body`` replaces the prompt-built one; the fields that make the response a
    stream (``stream``, ``stream_options.include_usage``) are still forced, because without
    them there is nothing to measure.
    """
    path = default_path(protocol, model)
    if cls.body is not None:
        return path, _force_streaming(protocol, model, copy.deepcopy(cls.body))
    prompt = rng.choice(cls.prompts) if cls.prompts else ""
    return path, _BODIES[protocol](model, prompt, cls.max_tokens)


def _gemini_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "contents": [{"role": "user", "parts": [{"text": prompt}]}],
        "generationConfig": {"maxOutputTokens": max_tokens},
    }


def _openai_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    # ``max_tokens`` rather than ``max_completion_tokens``: OpenAI still accepts it for chat
    # models, and vLLM, TGI and older OpenAI-compatible servers know only this one.
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _anthropic_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
    }


def _generic_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens}


_BODIES: dict[str, Callable[[str, str, int], dict[str, Any]]] = {
    "gemini": _gemini_body,
    "openai": _openai_body,
    "anthropic": _anthropic_body,
    "sse": _generic_body,
}


def _force_streaming(protocol: Protocol, model: str, body: dict[str, Any]) -> dict[str, Any]:
    if protocol in ("openai", "anthropic"):
        body.setdefault("model", model)
        body["stream"] = True
    if protocol == "openai":
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                  "include_usage": True}
    return body


# --- decoding ----------------------------------------------------------------------------------


def decode(protocol: Protocol, event: SSEEvent) -> Decoded:
    """What one SSE event of ``protocol`` carries. Raises ProtocolError on a malformed payload."""
    return _DECODERS[protocol](event)


def _json_object(event: SSEEvent) -> dict[str, Any]:
    try:
        obj = json.loads(event.data)
    except ValueError as exc:
        raise ProtocolError(
            f"event data is not JSON: {_short(event.data)!r} ({exc.args[0]})"
        ) from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"event data is JSON but not an object: {_short(event.data)!r}")
    return obj


def _short(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."


def _error_text(err: object) -> str:
    """One line from an API's error object: ``{"type"|"status"|"code": ..., "message": ...}``."""
    if isinstance(err, dict):
        kind = err.get("type") or err.get("status") or err.get("code")
        message = err.get("message")
        text = ": ".join(str(p) for p in (kind, message) if p not in (None, ""))
        return _short(text or json.dumps(err))
    return _short(str(err))


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _decode_openai(event: SSEEvent) -> Decoded:
    if event.data.strip() == "[DONE]":
        return Decoded(done=True)
    obj = _json_object(event)
    if "error" in obj:
        return Decoded(error=_error_text(obj["error"]))
    texts: list[str] = []
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict):
            # reasoning_content: the thinking that vLLM and DeepSeek stream before the answer.
            for key in ("reasoning_content", "content"):
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    texts.append(piece)
    usage = obj.get("usage")
    tokens = _int_or_none(usage.get("completion_tokens")) if isinstance(usage, dict) else None
    return Decoded(text="".join(texts), usage_output_tokens=tokens)


# Deltas that carry generated text; input_json_delta (tool arguments) is not prose.
_ANTHROPIC_TEXT_KEYS = {"text_delta": "text", "thinking_delta": "thinking"}


def _decode_anthropic(event: SSEEvent) -> Decoded:
    obj = _json_object(event)
    kind = obj.get("type") or event.event
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return _NOTHING
        piece = delta.get(_ANTHROPIC_TEXT_KEYS.get(str(delta.get("type")), ""))
        return Decoded(text=piece) if isinstance(piece, str) else _NOTHING
    if kind == "message_delta":
        usage = obj.get("usage")
        return Decoded(
            usage_output_tokens=_int_or_none(usage.get("output_tokens"))
            if isinstance(usage, dict) else None
        )
    if kind == "message_stop":
        return Decoded(done=True)
    if kind == "error" or event.event == "error":
        return Decoded(error=_error_text(obj.get("error", obj)))
    if kind == "content_block_start":
        block = obj.get("content_block")
        text = block.get("text") if isinstance(block, dict) else None
        return Decoded(text=text) if isinstance(text, str) and text else _NOTHING
    return _NOTHING   # message_start, ping, content_block_stop, and types added later


def _decode_gemini(event: SSEEvent) -> Decoded:
    obj = _json_object(event)
    if "error" in obj:
        return Decoded(error=_error_text(obj["error"]))
    texts: list[str] = []
    done = False
    for cand in obj.get("candidates") or ():
        if not isinstance(cand, dict):
            continue
        content = cand.get("content")
        for part in (content.get("parts") or ()) if isinstance(content, dict) else ():
            text = part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str) and text:
                texts.append(text)
        reason = cand.get("finishReason")
        done = done or bool(reason and reason != "FINISH_REASON_UNSPECIFIED")
    feedback = obj.get("promptFeedback")
    if not texts and isinstance(feedback, dict) and feedback.get("blockReason"):
        return Decoded(done=True, error=f"prompt blocked: {feedback['blockReason']}")
    meta = obj.get("usageMetadata")
    tokens = _int_or_none(meta.get("candidatesTokenCount")) if isinstance(meta, dict) else None
    if tokens is not None and isinstance(meta, dict):
        # Thinking tokens are generated output too; Gemini counts them apart.
        tokens += _int_or_none(meta.get("thoughtsTokenCount")) or 0
    return Decoded(text="".join(texts), usage_output_tokens=tokens, done=done)


def _decode_generic(event: SSEEvent) -> Decoded:
    if event.data.strip() == "[DONE]":
        return Decoded(done=True)
    obj = _json_object(event)
    if "error" in obj:
        return Decoded(error=_error_text(obj["error"]))
    text = obj.get("text")
    usage = obj.get("usage")
    return Decoded(
        text=text if isinstance(text, str) else "",
        usage_output_tokens=_int_or_none(usage.get("output_tokens"))
        if isinstance(usage, dict) else None,
        done=obj.get("done") is True,
    )


_DECODERS: dict[str, Callable[[SSEEvent], Decoded]] = {
    "gemini": _decode_gemini,
    "openai": _decode_openai,
    "anthropic": _decode_anthropic,
    "sse": _decode_generic,
}
