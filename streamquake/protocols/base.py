"""The contract every wire format implements, and the values that cross it.

One file per format, named as the protocol (``gemini.py``, ``openai.py``, ``anthropic.py``,
``sse.py``), holds all that is known of it, for the three parts that speak it: the load generator
(which request to send, what each event of the answer carries), the embedded target (which
requests to accept, how to encode its stream) and the fault proxy (which events carry generated
text, so dropping one loses text and nothing else). Nothing in this module knows a particular
format.
"""

from __future__ import annotations

import time
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

from streamquake.errors import StreamquakeError
from streamquake.jsontypes import JsonDict

# The formats by name; ``streamquake.protocols`` has one module of the same name for each.
Protocol = Literal["gemini", "openai", "anthropic", "sse"]


class ProtocolError(StreamquakeError):
    """An event's payload is not what the protocol says it should be (e.g. not JSON)."""


class BadRequest(ValueError):
    """The request body is not what this endpoint accepts; answered 400 with the message."""


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


class Decoded(NamedTuple):
    """What one event means to the load generator. A named tuple, not a frozen dataclass:
    one is made per event, and this builds in a fifth of the time."""

    text: str = ""                          # generated text this event carries ("" if none)
    usage_output_tokens: int | None = None  # the server's count of output tokens so far
    done: bool = False                      # the protocol's terminal event
    error: str | None = None                # the server reported an error in the stream
    response_id: str | None = None          # the response's id, on events that carry it
    finish: str | None = None               # why generation ended (finish/stop reason), on the
                                            #   event that says it
    model: str | None = None                # the model the answer says it came from


@dataclass(frozen=True)
class GenRequest:
    """What the simulated server needs from a request, whatever its protocol."""

    model: str
    prompt_tokens: int
    max_tokens: int | None
    include_usage: bool = False


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
    ``is_content_event`` is true exactly when ``decode`` finds text and nothing that ends the
    stream, so the proxy's count of content events is the client's (``tests/test_protocols.py``).
    """

    name: ClassVar[Protocol]
    # The format says why generation ended (a finish or stop reason) before its terminal event,
    # so a terminal event with no reason before it is a stream the server cut short.
    finish_required: ClassVar[bool] = False

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

    def force_streaming(self, model: str, body: JsonDict) -> JsonDict:
        """A user's own ``body``, with whatever makes the answer a measurable stream forced on.

        Takes ownership of ``body`` (the caller passes a copy) and returns it.
        """
        return body

    # --- load generator: reading the stream --------------------------------------------------

    @abstractmethod
    def decode(self, event: Event) -> Decoded:
        """What one event carries. Raises ProtocolError on a malformed payload."""

    # --- target: serving a stream ------------------------------------------------------------

    @abstractmethod
    def parse(self, body: object, model: str | None) -> GenRequest:
        """Validate a request body; ``model`` comes from the URL where the format puts it."""

    @abstractmethod
    def error_body(self, status: int, message: str) -> JsonDict:
        """The format's own JSON error shape."""

    @abstractmethod
    def encoder(self, request: GenRequest, ids: bool) -> StreamEncoder:
        """A fresh encoder for one response."""

    # --- proxy: what an event is worth -------------------------------------------------------

    @abstractmethod
    def is_content_event(self, event: Event) -> bool:
        """True when losing ``event`` loses generated text and nothing else.

        An event that also ends the stream (a finish reason, a stop) or reports an error is not
        content: a proxy that drops "content" must cost the client text, not its ending.
        """
