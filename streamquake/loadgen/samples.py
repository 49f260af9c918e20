"""The records that cross from the load process to the runner: one line per request in
``samples-<pid>.jsonl``, and one line per open-loop arrival that was due but never sent in
``unsent-<pid>.jsonl`` (a file of its own, so that nothing that counts requests counts one)."""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import orjson

# Each failed request is counted in exactly one kind; see docs/measurement.md.
ErrorKind = Literal[
    "connect",               # no connection (refused, DNS, connect timeout, closed at once)
    "timeout",               # no complete stream within the request timeout
    "http_status",           # a non-2xx answer or a redirect
    "protocol",              # an event, or the HTTP framing, that cannot be parsed
    "truncated",             # the stream ended or was reset before its final event
    "tls",                   # TLS handshake or certificate verification failed
    "content_type",          # 2xx, but not text/event-stream (an HTML page, a JSON body)
    "unsupported_encoding",  # a compressed (Content-Encoding: gzip ...) event stream
    "limit",                 # the stream broke a parser or client limit (a line that never ends)
    "tool_call",             # a tool call whose JSON arguments never closed by the stream's end
    "stream_error",          # an error event inside a 200 stream: the server gave up mid-answer
    "safety_stop",           # a finish reason that says a safety filter stopped the answer
]
ERROR_KINDS: tuple[str, ...] = typing.get_args(ErrorKind)

BUNCH_MIN_EVENTS = 8    # content events a stream needs for ``bunched`` to say anything
# A stream whose response headers were held back with its answer (``RequestSample.held``): the
# whole answer came within this share of the wait for the headers, and faster than this a gap.
HELD_SHARE = 0.25
HELD_GAP_MS = 2.0


# How a conversation's session ended (on its last turn's sample): every turn answered; a turn
# failed (the session stops there); or the run ended, or the client cancelled a turn, first.
SessionEnd = Literal["completed", "failed", "abandoned"]
SESSION_ENDS: tuple[SessionEnd, ...] = typing.get_args(SessionEnd)


@dataclass
class RequestSample:
    """Everything measured about one streamed request. Times are epoch seconds / milliseconds."""

    cls: str                              # request class name
    sent: float                           # epoch s the request's last byte was written (or,
                                          #   when it never was, the attempt started)
    scheduled: float | None = None        # epoch s it was due (open loop); None in closed loop
    send_ms: float | None = None          # attempt start -> last byte written (pool wait,
                                          #   connect, write); None if never written
    # send_ms in parts (None: not part of this request, or never written); what they leave
    # of send_ms is the wait for a pooled connection (and the pool's own work).
    dns_ms: float | None = None           # name resolution (none for an IP or a reused socket)
    connect_ms: float | None = None       # TCP connect (first attempt to established)
    tls_ms: float | None = None           # TLS handshake
    write_ms: float | None = None         # connection ready -> last byte written
    reused: bool = False                  # sent on a pooled connection (no DNS/connect/TLS)
    trace_id: str | None = None           # W3C trace id of the ``traceparent`` it was sent with
    span_id: str | None = None            # ... and its span id (the parent of a server's spans)
    body_bytes: int = 0                   # event-stream bytes read (HTTP chunk framing aside)
    ttfb_ms: float | None = None          # sent -> first response byte
    head_lag_ms: float = 0.0              # of that wait, the time the load process's hub was
                                          #   late (the saturation guard's; 0 without one)
    ttft_ms: float | None = None          # sent -> first event carrying generated content
                                          #   of any kind (reasoning, text, tool arguments)
    ttfa_ms: float | None = None          # sent -> first event of the answer (text or tool-call
                                          #   arguments), after any reasoning
    e2e_ms: float | None = None           # sent -> end of stream (or error)
    itl_ms: list[float] = field(default_factory=list)  # one gap per content event after first
    content_events: int = 0               # events that carried generated content
    reasoning_events: int = 0             # ... of which reasoning (thinking)
    tool_events: int = 0                  # ... of which tool-call argument deltas
    shared_stamps: int = 0                # content events dated with the stamp of the one
                                          #   before (read together): their gap reads as 0
    content_reads: int = 0                # reads that brought content events
    burst_events: int = 0                 # content events held back on the way and released
                                          #   together (loadgen/tally.py BURST_WAIT_MS)
    burst_reads: int = 0                  # the reads that brought them
    response_id: str | None = None        # the response's own id (OpenAI/Anthropic id, Gemini
                                          #   responseId), to find it in the server's logs
    model: str | None = None              # the model the answer named (first event naming one)
    finish_reason: str | None = None      # why the server said generation ended (its words)
    output_tokens: int = 0                # server usage when present, else content_events
                                          #   (usage_tokens None says it was counted)
    usage_tokens: int | None = None       # what the server's usage said, if it said
    reasoning_tokens: int | None = None   # the reasoning tokens its usage counted, if it said
    missing_events: int = 0               # gaps in SSE ``id:`` sequence numbers (chunk loss)
    expected_events: int = 0              # events the server sent, by ids/usage (0 = unknown)
    attempt: int = 1                      # 1 for the first try; 2, 3 for retries (load.retries)
    retried: bool = False                 # this attempt failed and was retried: counted apart
    cancelled: bool = False               # the client closed it early (its class's ``cancel``):
                                          #   neither a success nor an error, counted apart
    turn: int | None = None               # a conversation's turn (1, 2, ...): its class's sessions
    session: SessionEnd | None = None     # on a session's last turn: how the session ended
    cache_n: int | None = None            # prompt tokens the server read from its prefix cache
    prompt_n: int | None = None           # ... and read anew (llama-server's ``timings``)
    stalls: int = 0                       # inter-event gaps above the stall threshold (server's)
    client_stalls: int = 0                # such gaps that were the load process's own lateness
    clock: Literal["kernel", "user"] = "user"   # event times: kernel receive stamps, or not
    status: int | None = None             # HTTP status
    error: ErrorKind | None = None
    error_detail: str | None = None

    @property
    def started(self) -> float:
        """Epoch s the attempt started (before the pool, the connect and the write)."""
        return self.sent - (self.send_ms or 0.0) / 1000.0

    @property
    def queue_delay_ms(self) -> float | None:
        """Due -> the attempt's start (open loop): the wait for a free slot."""
        if self.scheduled is None:
            return None
        return max(0.0, (self.started - self.scheduled) * 1000.0)

    @property
    def ttft_scheduled_ms(self) -> float | None:
        """Due -> first token (open loop): what the user waited, queueing and sending
        included."""
        if self.scheduled is None or self.ttft_ms is None:
            return None
        return (self.queue_delay_ms or 0.0) + (self.send_ms or 0.0) + self.ttft_ms

    @property
    def e2e_scheduled_ms(self) -> float | None:
        """Due -> end of stream (open loop)."""
        if self.scheduled is None or self.e2e_ms is None:
            return None
        return (self.queue_delay_ms or 0.0) + (self.send_ms or 0.0) + self.e2e_ms

    @property
    def held(self) -> bool | None:
        """The response headers were held back with the answer, however its events were read:
        the whole answer, from the headers to its last content event, came within
        ``HELD_SHARE`` of the wait for the headers (TTFB), at less than ``HELD_GAP_MS`` a gap.
        A gateway that holds the answer until the server is done, then writes each event on its
        own (LiteLLM's proxy) shows so; a server sending its headers at once, or with its first
        token and its next tokens at the pace it makes them, does not, nor does one whose
        headers came at once and whose answer came later in one read (a fast server's, read
        late by a load process that waited for a core: its events share one stamp, so their
        gaps read 0). The time our own hub was late within that wait (``head_lag_ms``) does
        not count: bytes that waited unread are stamped as the newest of them, so a late
        first read dates the head as late as the tokens behind it. None with too few content
        events to say."""
        if (self.content_events < BUNCH_MIN_EVENTS or self.ttfb_ms is None
                or self.ttft_ms is None or not self.itl_ms):
            return None
        span = sum(self.itl_ms)
        wait = self.ttfb_ms - self.head_lag_ms
        answer = max(0.0, self.ttft_ms - self.ttfb_ms) + span
        return answer <= HELD_SHARE * wait and span <= HELD_GAP_MS * len(self.itl_ms)

    @property
    def bunched(self) -> bool | None:
        """The stream arrived in bursts: at least half its content events came in bursts
        (``burst_events``: held back somewhere, then released together), in two bursts or
        more, or whole in one; or its headers were held back with the whole answer
        (``held``); None when it had too few content events to say. One burst in a stream
        that came otherwise is a hiccup (a server catching up after a pause)."""
        if self.content_events < BUNCH_MIN_EVENTS:
            return None
        return bool(self.held) or 2 * self.burst_events >= self.content_events and (
            self.burst_reads >= 2 or self.content_reads == 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second after the first: successful streams with tokens, whose
        pace the client saw. None for a stream that arrived in bursts (``bunched``): its
        tokens after the first came as fast as a gateway or a throttled link released them,
        not as the server made them (a tbf fault read ~4,000 tokens/s so), which would read
        as an improvement; ``Stats.bunched`` counts them."""
        if self.error is not None or self.cancelled or self.e2e_ms is None \
                or self.ttft_ms is None \
                or self.output_tokens <= 0 or self.e2e_ms <= self.ttft_ms or self.bunched:
            return None
        return self.output_tokens / ((self.e2e_ms - self.ttft_ms) / 1e3)

    def to_json(self) -> str:
        # Not dataclasses.asdict: it deep-copies the gaps list, which cost more than the line.
        # orjson: the json module's float formatting was most of a line's cost (its numbers
        # read back the same; a float that is not finite, which no sample holds, is null).
        # orjson reads the dataclass's fields itself, in their order: 3 us a 50-token sample
        # against 12 us through a dict of them.
        return orjson.dumps(self).decode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestSample:
        if data.keys() == _SAMPLE_FIELDS and cls is RequestSample:
            # A line as to_json writes it: every field, nothing else, so __init__ would only
            # copy them (23 us a line against 1; the runner reads every line while a run
            # lasts, on the load process's core: truth.py's 500 streams, 540 lines at a tick).
            sample = object.__new__(cls)
            sample.__dict__.update(data)
            return sample
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


_SAMPLE_FIELDS = frozenset(RequestSample.__dataclass_fields__)


UnsentReason = Literal[
    "run_ended",    # no slot (load.arrival.max_inflight) came free before the run's end
    "stopped",      # the load process stopped its user while the arrival waited for a slot
]


@dataclass
class UnsentArrival:
    """An open-loop arrival that was due (its time came before the run's end) but was never
    sent. Every due arrival is either a request sample or one of these."""

    cls: str                              # request class it would have been
    scheduled: float                      # epoch s it was due
    given_up: float                       # epoch s the load process gave up on it
    reason: UnsentReason = "run_ended"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UnsentArrival:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
