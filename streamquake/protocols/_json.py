"""JSON in and out of SSE events, the same for every format: compact encoding, byte templates,
and lenient reading of payloads that come off the network."""

from __future__ import annotations

import json
from collections.abc import Mapping

import orjson

from streamquake.jsontypes import JsonDict
from streamquake.protocols.base import Event, ProtocolError

# Stands where a token's JSON string goes in an event template (see ``split``).
TOKEN_MARK = "\x00TOKEN\x00"
# Payload text kept in a reason. Long, because the client redacts credentials from the whole
# reason before it cuts it to what a sample keeps: a key cut in half here would escape that.
_DETAIL_MAX = 4096


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def split(template: object) -> tuple[bytes, bytes]:
    """Encode ``template`` once and cut it where ``TOKEN_MARK``'s JSON string is.

    A token event is then ``head + token_json + tail``: no JSON encoding per token.
    """
    head, tail = dumps(template).split(dumps(TOKEN_MARK), 1)
    return head, tail


# Payloads are JSON values inside the formats: what a server sent is known after isinstance checks.
def json_object(event: Event) -> JsonDict:
    """The event's data as a JSON object; ProtocolError when it is not one. Read with orjson
    (strict RFC 8259: no NaN or Infinity, no lone surrogates), the per-event path's JSON."""
    try:
        obj = orjson.loads(event.data)
    except ValueError as exc:
        raise ProtocolError(
            f"event data is not JSON: {short(event.data)!r} ({exc.args[0]})"
        ) from exc
    if not isinstance(obj, dict):
        raise not_an_object(event)
    return obj


def not_an_object(event: Event) -> ProtocolError:
    return ProtocolError(f"event data is JSON but not an object: {short(event.data)!r}")


def object_or_none(event: Event) -> JsonDict | None:
    """The event's data as a JSON object, or None (``[DONE]``, not JSON, not an object)."""
    try:
        obj = json.loads(event.data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def short(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."


def error_text(err: object) -> str:
    """One line from an API's error object: ``{"type"|"status"|"code": ..., "message": ...}``."""
    if isinstance(err, dict):
        kind = err.get("type") or err.get("status") or err.get("code")
        message = err.get("message")
        text = ": ".join(str(p) for p in (kind, message) if p not in (None, ""))
        return short(text or json.dumps(err))
    return short(str(err))


# A server's token count is a count: below 0 or beyond this it says nothing about the stream.
COUNT_MAX = 2**31 - 1


def prompt_timings(obj: Mapping[str, object]) -> tuple[int | None, int | None]:
    """(cache_n, prompt_n) of llama-server's ``timings`` in an event's object: the prompt
    tokens read from the prefix cache and read anew; (None, None) where it has none."""
    timings = obj.get("timings")
    if type(timings) is not dict:
        return None, None
    return int_or_none(timings.get("cache_n")), int_or_none(timings.get("prompt_n"))


def int_or_none(value: object) -> int | None:
    """A usage token count as the server sent it, or None when it is not one.

    A negative or absurd count (``completion_tokens: -50``) is no usage at all: the client then
    counts the tokens it read, as for a server that sends no usage.
    """
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= COUNT_MAX:
        return value
    return None


def shape(value: object) -> str:
    """What a JSON value is, in words: ``missing``/``null``/``a list``... for a reason."""
    if value is None:
        return "null or missing"
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)
