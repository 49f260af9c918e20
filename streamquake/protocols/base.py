"""The contract every wire format implements, and the values that cross it.

One file per format, named as the protocol (``gemini.py``, ``openai.py``, ``anthropic.py``,
``sse.py``), holds all that is known of it, for the three parts that speak it: the load generator
(which request to send, what each event of the answer carries), the embedded target (its routes,
which requests to accept, how to encode its stream) and the fault proxy (which events carry
generated text, so dropping one loses text and nothing else). Nothing in this module knows a
particular format.
"""

from __future__ import annotations

import json
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

from streamquake.errors import StreamquakeError
from streamquake.jsontypes import JsonDict

# The formats by name; ``streamquake.protocols`` has one module of the same name for each.
Protocol = Literal["gemini", "openai", "anthropic", "sse", "openai_responses", "llama_cpp"]


class ProtocolError(StreamquakeError):
    """An event's payload is not what the protocol says it should be (e.g. not JSON)."""


class BadRequest(ValueError):
    """The request is not what this endpoint accepts; answered ``status`` (400 unless its URL
    names no method the format has: 404) with the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Event(typing.Protocol):
    """One dispatched SSE event, as the formats read it; ``loadgen.sse.SSEEvent`` is one.

    Structural, so that the load generator's parser and the proxy's framer need not share a class.
    """

    @property
    def event(self) -> str:
        """The ``event:`` field; "message" when the event has none."""

    @property
    def data(self) -> str:
        """The ``data:`` lines, joined by "\\n"."""


class ToolDelta(NamedTuple):
    """A piece of one tool call in an event: ``key`` tells the call apart from the stream's
    others (its index or id), ``piece`` is the next stretch of its JSON arguments ("" on the
    event that opens the call), ``name`` the function's name where the event gives it."""

    key: str
    piece: str = ""
    name: str | None = None


class Decoded(NamedTuple):
    """What one event means to the load generator. A named tuple, not a frozen dataclass:
    one is made per event, and this builds in a fifth of the time.

    Generated content comes in three kinds, counted apart: answer ``text``, ``reasoning``
    (thinking streamed before the answer) and ``tools`` (tool-call argument deltas). An event
    that carries any of them is a content event (:attr:`generated`)."""

    text: str = ""                          # answer text this event carries ("" if none)
    usage_output_tokens: int | None = None  # the server's count of output tokens so far
    done: bool = False                      # the protocol's terminal event
    error: str | None = None                # the server reported an error in the stream
    response_id: str | None = None          # the response's id, on events that carry it
    finish: str | None = None               # why generation ended (finish/stop reason), on the
                                            #   event that says it
    model: str | None = None                # the model the answer says it came from
    reasoning: str = ""                     # reasoning (thinking) text this event carries
    tools: tuple[ToolDelta, ...] = ()       # tool calls opened or continued by this event
    usage_reasoning_tokens: int | None = None   # the server's count of reasoning tokens
    # The engine's account of the prompt (llama-server's ``timings``): tokens read from its
    # prefix cache (``cache_n``) and read anew (``prompt_n``), on the event that carries it.
    cache_n: int | None = None
    prompt_n: int | None = None

    @property
    def tool_args(self) -> bool:
        """The event carries a piece of some tool call's arguments (an argument delta)."""
        return any(t.piece for t in self.tools)

    @property
    def generated(self) -> bool:
        """The event carries generated content of any kind: a content event."""
        return bool(self.text or self.reasoning) or self.tool_args


@dataclass(frozen=True)
class GenRequest:
    """What the simulated server needs from a request, whatever its protocol."""

    model: str
    prompt_tokens: int
    max_tokens: int | None
    include_usage: bool = False
    prompt: str = ""             # the prompt's text, for a target that caches prefixes


@dataclass(frozen=True)
class Route:
    """One endpoint the embedded target serves for a format: ``method`` requests to ``path``
    (aiohttp's pattern: ``{name}`` or ``{name:regex}`` for a variable part), answered in
    ``speaks`` (default: the format that declares it; OpenAI's legacy completions are a format
    of their own beside chat, on chat's reader)."""

    path: str
    method: str = "POST"
    speaks: WireProtocol | None = None


@dataclass(frozen=True)
class Completion:
    """How a stream ended: tokens sent and whether the request's max tokens cut it short."""

    output_tokens: int
    truncated: bool


# Where a stamped event's send time goes until ``stamp`` fills it in, right before the write.
# No encoded event holds a NUL byte (JSON escapes it), so the slot cannot match content.
STAMP_SLOT = b"\0sent\0"


def stamp(frame: bytes, at_ns: int | None = None) -> bytes:
    """``frame`` (one write's events) with every ``STAMP_SLOT`` set to ``at_ns`` (epoch ns;
    default: now)."""
    return frame.replace(STAMP_SLOT, b"%d" % (time.time_ns() if at_ns is None else at_ns))


def sse_event(data: JsonDict, event: str | None = None) -> bytes:
    """One SSE event block: ``event: NAME`` (where given), one ``data:`` line, a blank line."""
    head = b"" if event is None else b"event: %s\n" % event.encode()
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class StreamEncoder(ABC):
    """Frames one response's events; every event carries ``id: N`` (1-based) when ids are on.

    With ``stamp_send_time`` set (before the first event), every event opens with an SSE
    comment ``: t=STAMP_SLOT`` that ``stamp`` turns into ``: t=<epoch ns>`` at send time, for
    benchmarks that measure how late a client sees each event. Comments are part of SSE, so
    conformant clients (browsers, the OpenAI and Anthropic SDKs) skip them.

    Encoders build each event from byte templates prepared once per response, because the
    per-token path is what bounds how many events/s one core of the target can serve.
    """

    _eol: ClassVar[bytes] = b"\n"

    def __init__(self, request: GenRequest, ids: bool) -> None:
        self.request = request
        self._ids = ids
        self._seq = 0
        self.stamp_send_time = False
        self.response_id: str | None = None    # the id this response carries, if its format has one

    def _event(self, data: bytes, event: bytes | None = None) -> bytes:
        eol = self._eol
        head = b"" if event is None else b"event: " + event + eol
        if self._ids:
            self._seq += 1
            head = b"id: %d%s%s" % (self._seq, eol, head)
        if self.stamp_send_time:
            head = b": t=%s%s%s" % (STAMP_SLOT, eol, head)
        return b"%sdata: %s%s%s" % (head, data, eol, eol)

    def opening(self) -> bytes:
        """Events sent once generation is admitted, before the first token."""
        return b""

    # What the answer holds besides text, set before ``opening`` (the embedded target's
    # ``reasoning_tokens`` and ``tool_call``): the first tokens are reasoning, the rest a tool
    # call's arguments. A format with no such parts sends them as text (these defaults).
    reasoning_first = False
    tool_name: str | None = None
    # The engine's own account of the prompt (llama-server's ``timings``: prompt_n, cache_n,
    # prompt_ms), set by a target that keeps a prefix cache; a format that carries it sends it
    # on its last event.
    timings: JsonDict | None = None

    def reasoning(self, text_json: bytes) -> bytes:
        """One reasoning (thinking) event."""
        return self.token(text_json)

    def tool_args(self, piece_json: bytes, first: bool, last: bool) -> bytes:
        """One delta of the tool call's JSON arguments (``first`` opens the call, ``last``
        closes its JSON); ``piece_json`` is the piece as a JSON string."""
        return self.token(piece_json)

    @abstractmethod
    def token(self, text_json: bytes) -> bytes:
        """One content event; ``text_json`` is the token already encoded as a JSON string."""

    @abstractmethod
    def closing(self, done: Completion) -> bytes:
        """Events that end the stream."""


class WireProtocol(ABC):
    """One wire format, for every part that speaks it. Instances are stateless and shared.

    Contract: ``decode`` raises only ``ProtocolError`` (a payload that is not the format's);
    ``parse`` raises only ``BadRequest``; ``is_content_event`` never raises and answers False for
    what it cannot read. On every event the format's own target encoder produces,
    ``is_content_event`` is true exactly when ``decode`` finds generated content (text,
    reasoning or tool-call arguments: ``Decoded.generated``) and nothing that ends the stream,
    so the proxy's count of content events is the client's (``tests/test_protocols.py``).
    """

    name: ClassVar[Protocol]
    # The format says why generation ended (a finish or stop reason) before its terminal event,
    # so a terminal event with no reason before it is a stream the server cut short.
    finish_required: ClassVar[bool] = False
    # A body that ends cleanly (its chunked terminator: the server finished the response) after
    # the finish reason arrived is a complete stream, terminal event or not: some servers of the
    # format send none (transformers serve never sends OpenAI's ``[DONE]``). A body that ends
    # before the finish reason is still cut short.
    ends_with_body: ClassVar[bool] = False
    # Where the format's generated text is, in words, for a reader told that none was found.
    text_is: ClassVar[str] = ""
    # Finish reasons that mean the server's safety filter stopped the answer (Gemini's SAFETY,
    # RECITATION ...): no answer the client asked for, whatever came before.
    safety_finishes: ClassVar[frozenset[str]] = frozenset()

    # --- load generator: asking for a stream -------------------------------------------------

    @abstractmethod
    def path(self, model: str) -> str:
        """The request path (with its query) of a streaming request for ``model``."""

    def headers(self) -> dict[str, str]:
        """Headers the format requires besides the user's own (keys, versions)."""
        return {"Content-Type": "application/json", "Accept": "text/event-stream"}

    @abstractmethod
    def body(self, model: str, prompt: str, max_tokens: int) -> JsonDict:
        """The JSON body of a streaming request with one user ``prompt``."""

    def body_for(self, path: str, model: str, prompt: str, max_tokens: int) -> JsonDict:
        """``body`` for a request sent to ``path`` (the scenario's ``target.path``, or the
        format's own): a format with several endpoints asks each in its own shape."""
        return self.body(model, prompt, max_tokens)

    def force_streaming(self, model: str, body: JsonDict) -> JsonDict:
        """A user's own ``body``, with whatever makes the answer a measurable stream forced on.

        Takes ownership of ``body`` (the caller passes a copy) and returns it.
        """
        return body

    # --- load generator: reading the stream --------------------------------------------------

    @abstractmethod
    def decode(self, event: Event) -> Decoded:
        """What one event carries. Raises ProtocolError on a malformed payload."""

    def plain_text(self, data: bytes) -> tuple[str | None, str | None, str] | None:
        """The load generator's shortcut for the event nearly every stream is made of: given
        an event's raw ``data`` bytes, ``(response_id, model, text)`` (the first two None where
        the event has none) when ``decode`` would find answer text and nothing else (no
        reasoning, tool call, finish, usage, error, prompt timings or terminal event); None
        for anything else, which then goes through ``decode``. Never raises. A format that
        keeps this default has no shortcut: every event of it is decoded
        (``has_plain_text``)."""
        return None

    @classmethod
    def has_plain_text(cls) -> bool:
        return cls.plain_text is not WireProtocol.plain_text

    # --- target: serving a stream ------------------------------------------------------------

    @abstractmethod
    def routes(self) -> tuple[Route, ...]:
        """Where the embedded target serves this format. It asks registered formats only: an
        unregistered variant (OpenAI's legacy completions) is a route's ``speaks``."""

    def url_model(self, params: Mapping[str, str], query: Mapping[str, str], path: str
                  ) -> str | None:
        """The model a request to one of ``routes`` names in its URL (``params``: the route's
        variable parts; ``query``; ``path``, for the message), None where the format names it
        in the body. Raises BadRequest for a URL the format does not stream from."""
        return None

    @abstractmethod
    def parse(self, body: object, model: str | None) -> GenRequest:
        """Validate a request body; ``model`` comes from the URL where the format puts it."""

    @abstractmethod
    def error_body(self, status: int, message: str) -> JsonDict:
        """The format's own JSON error shape."""

    def error_event(self, message: str | None = None) -> bytes:
        """The event a server of the format sends when it gives up mid-answer (the stream then
        ends); ``message`` in its words where the format carries one. By default a ``data:``
        line holding an ``error`` object, as OpenAI's chat completions (and llama-server, and
        most OpenAI-compatible servers) send it."""
        text = message or "The server had an error while processing your request."
        return sse_event({"error": {"message": text, "type": "server_error", "param": None,
                                    "code": None}})

    @abstractmethod
    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        """A fresh encoder for one response."""

    # --- proxy: what an event is worth -------------------------------------------------------

    def is_usage_event(self, event: Event) -> bool:
        """True when ``event`` carries the server's usage count and nothing else a reader
        needs: no content, no finish reason, not the end, no error (OpenAI's last chunk under
        ``stream_options.include_usage``). A format whose usage rides on other events has
        none. Never raises."""
        try:
            d = self.decode(event)
        except ProtocolError:
            return False
        return (d.usage_output_tokens is not None and not d.generated and d.finish is None
                and not d.done and d.error is None)

    def tool_args_delta(self, event: Event) -> ToolDelta | None:
        """The tool call's argument chunk ``event`` carries, when that is all it carries: one
        piece of one streamed call's JSON arguments (OpenAI chat's
        ``delta.tool_calls[].function.arguments``, Anthropic's ``input_json_delta``, the
        Responses API's ``response.function_call_arguments.delta``), no text, no finish, not
        the end, no error. None otherwise, and for a call sent whole (Gemini's
        ``functionCall``: it has no chunks). Each format's ``decode`` knows its shape. Never
        raises."""
        try:
            d = self.decode(event)
        except ProtocolError:
            return None
        if (len(d.tools) != 1 or d.text or d.reasoning or d.finish is not None or d.done
                or d.error is not None):
            return None
        (call,) = d.tools
        return call if call.key and call.piece else None

    @abstractmethod
    def is_content_event(self, event: Event) -> bool:
        """True when losing ``event`` loses generated text and nothing else.

        An event that also ends the stream (a finish reason, a stop) or reports an error is not
        content: a proxy that drops "content" must cost the client text, not its ending.
        """
