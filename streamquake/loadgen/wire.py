"""The load generator's side of the wire formats: the request a class sends, and what each
event of the answer means. The formats themselves live in ``streamquake.protocols``; what stays
here is the load's own choice (which prompt, the class's own body).
"""

from __future__ import annotations

import copy
import functools
import random
import re
from collections.abc import Callable

from streamquake.jsontypes import JsonDict
from streamquake.loadgen import speedups
from streamquake.loadgen.plan import RequestClassPlan
from streamquake.loadgen.sse_parser import SSEEvent
from streamquake.protocols import Decoded, Protocol, ProtocolError, get

__all__ = ["Decoded", "ProtocolError", "build_request", "decode", "decoder", "default_path",
           "ends_with_body", "finish_required", "join_path", "protocol_headers",
           "PlainTemplate", "plain_text", "safety_finishes"]


def default_path(protocol: Protocol, model: str) -> str:
    return get(protocol).path(model)


def protocol_headers(protocol: Protocol) -> dict[str, str]:
    """Headers the protocol requires besides the user's own (keys, versions)."""
    return get(protocol).headers()


def build_request(
    protocol: Protocol, model: str, cls: RequestClassPlan, rng: random.Random,
    to: str | None = None,
) -> tuple[str, JsonDict]:
    """Path and JSON body of one streaming request of class ``cls``; ``to``: the path it goes
    to instead of the protocol's own (``target.path``), whose endpoint may ask its own body.

    A class's full ``body`` replaces the prompt-built one; the fields that make the response a
    stream (``stream``, ``stream_options.include_usage``) are still forced, because without
    them there is nothing to measure. A class's ``priority`` is the body field ``priority``.
    """
    path, body = _body(protocol, model, cls, rng, to)
    if cls.priority is not None:
        body["priority"] = cls.priority
    return path, body


def _body(
    protocol: Protocol, model: str, cls: RequestClassPlan, rng: random.Random, to: str | None,
) -> tuple[str, JsonDict]:
    wire = get(protocol)
    path = wire.path(model)
    route = path if to is None else to
    if cls.body is not None:
        return path, wire.force_streaming(model, copy.deepcopy(cls.body))
    if not cls.prompts:
        return path, wire.body_for(route, model, "", cls.max_tokens)
    if cls.prompt_max_tokens is None:
        return path, wire.body_for(route, model, rng.choice(cls.prompts), cls.max_tokens)
    i = rng.randrange(len(cls.prompts))      # a dataset: each prompt with its own max_tokens
    caps = cls.prompt_max_tokens
    return path, wire.body_for(route, model, cls.prompts[i], (caps[i] if i < len(caps) else 0)
                               or cls.max_tokens)


def decode(protocol: Protocol, event: SSEEvent) -> Decoded:
    """What one SSE event of ``protocol`` carries. Raises ProtocolError on a malformed payload."""
    return get(protocol).decode(event)


def decoder(protocol: Protocol) -> Callable[[SSEEvent], Decoded]:
    """``decode`` for one protocol, looked up once (a stream's events are all of one)."""
    return get(protocol).decode


PlainCheck = Callable[[bytes], "tuple[str | None, str | None, str] | None"]


def plain_text(protocol: Protocol) -> PlainCheck | None:
    """``protocol``'s shortcut for plain answer-text events (``WireProtocol.plain_text``), or
    None where it has none."""
    wire = get(protocol)
    return wire.plain_text if wire.has_plain_text() else None


# Text no JSON encoder writes other than as itself (no escapes, nothing that some encoders
# escape: quotes, backslash, slash, < > &, control or non-ASCII characters).
_VERBATIM = re.compile(r"[A-Za-z0-9 .,!?;:'()_-]+")
# A JSON string's body that needs no escape and holds no escape: printable ASCII but the
# quote and the backslash.
_STRING_BODY = re.compile(rb'[\x20\x21\x23-\x5b\x5d-\x7e]+')
_framed_events = speedups.framed_events


class PlainTemplate:
    """A stream's plain events, checked by the bytes around their text: one server sends
    every answer-text event of a stream alike but for the text (the same id, model, creation
    time, fields and order), so once ``check`` (the protocol's ``plain_text``) has vouched for
    one event, another that is the same bytes around a different text is plain too, with the
    same response id and model, and needs no parse.

    Learned from an event whose text is ``_VERBATIM`` and appears quoted exactly once in its
    bytes: that is the text's string, so the bytes before and after it are the event's
    every other field. An event then matches when it is those bytes around a non-empty
    ``_STRING_BODY``: valid JSON of the same shape, whose only difference is the text (so
    ``decode`` would read it as text alone, as it read the one learned). Anything else goes
    to ``check``, which learns again from what it vouches for (a server whose events change
    otherwise, a usage count say, is checked event by event as before)."""

    __slots__ = ("check", "head", "tail", "size", "got", "framed_head", "framed_tail")

    def __init__(self, check: PlainCheck) -> None:
        self.check = check
        self.head = self.tail = b""
        self.size = -1                  # no template yet: no event is shorter than this
        self.got: tuple[str | None, str | None] = (None, None)
        # The same, as a whole read of one SSE event: ``data: `` and the event's end around it.
        self.framed_head = self.framed_tail = b""

    def framed(self, read: bytes) -> tuple[int, int]:
        """``(k, end)``: ``read`` begins with ``k`` whole SSE events, ending at ``end``, each
        one ``data:`` line (no id, no CR) whose data the template vouches for: what
        :meth:`SSEParser.plain` would give of ``read[:end]`` as that many events, and this
        would answer each with ``got``; ``end`` is ``len(read)`` where the read is nothing
        else, and ``(0, 0)`` for a read that begins with anything else. The text between
        holds no line end (nor a quote, which ends it), so each is one line and one event.
        Compiled where the compiled part is built (speedups.py)."""
        if self.size < 0 or len(read) <= self.size + 8:
            return 0, 0
        if _framed_events is not None:
            return _framed_events(read, self.framed_head, self.framed_tail)
        return self.framed_py(read)

    def framed_py(self, read: bytes) -> tuple[int, int]:
        """:meth:`framed` in Python (``_speedups.framed_events`` is its compiled twin)."""
        head, tail = self.framed_head, self.framed_tail
        at = count = 0
        if not tail.startswith(b'"'):
            return count, at
        while at < len(read):
            if not read.startswith(head, at):
                break
            text = _STRING_BODY.match(read, at + len(head))
            if text is None or not read.startswith(tail, text.end()):
                break
            at = text.end() + len(tail)
            count += 1
        return count, at

    def __call__(self, data: bytes) -> tuple[str | None, str | None] | None:
        """``(response_id, model)`` of a plain answer-text event, None for any other."""
        head = self.head
        if (len(data) > self.size >= 0 and data.startswith(head) and data.endswith(self.tail)
                and _STRING_BODY.fullmatch(data, len(head), len(data) - len(self.tail))):
            return self.got
        got = self.check(data)
        if got is None:
            return None
        rid, model, text = got
        if _VERBATIM.fullmatch(text):
            quoted = b'"' + text.encode("ascii") + b'"'
            at = data.find(quoted)
            if at >= 0 and data.find(quoted, at + 1) < 0:
                self.head, self.tail = data[:at + 1], data[at + len(quoted) - 1:]
                self.size = len(self.head) + len(self.tail)
                self.got = (rid, model)
                self.framed_head, self.framed_tail = b"data: " + self.head, self.tail + b"\n\n"
        return rid, model


def finish_required(protocol: Protocol) -> bool:
    """Whether ``protocol`` says why generation ended before its terminal event."""
    return get(protocol).finish_required


def ends_with_body(protocol: Protocol) -> bool:
    """Whether a body that ends cleanly after the finish reason is a complete ``protocol``
    stream, with no terminal event (``WireProtocol.ends_with_body``)."""
    return get(protocol).ends_with_body


# Asked once per request with the same few answers (1% of a 500-stream load process's CPU).
@functools.lru_cache(maxsize=64)
def join_path(prefix: str, path: str) -> str:
    """The URL path of a request: the base URL's path, then the API's own ``path``, with a
    prefix the two share written once. A base URL given the way SDKs take it
    (``http://host:8000/v1``) and the path ``/v1/chat/completions`` make
    ``/v1/chat/completions``, not ``/v1/v1/chat/completions``."""
    base = prefix.rstrip("/")
    route = path.split("?", 1)[0]
    parts = [p for p in base.split("/") if p]
    for k in range(len(parts), 0, -1):      # the longest end of the base that starts the path
        shared = "/" + "/".join(parts[-k:])
        if route == shared or route.startswith(shared + "/"):
            return "/" + "/".join(parts[:-k]) + path if parts[:-k] else path
    return base + path


def safety_finishes(protocol: Protocol) -> frozenset[str]:
    """The finish reasons that mean a safety filter stopped the answer."""
    return get(protocol).safety_finishes
