"""Measure one streaming request, timestamping every SSE event as its bytes come off the socket.

Runs under gevent (inside the Locust process, or any greenlet). geventhttpclient parses the
HTTP response, but its ``read()`` blocks for a whole block and Locust's ``iter_lines()`` hands
lines over late, so :func:`_read_some` takes whatever body bytes each ``recv`` brought.

Its parts: :mod:`~streamquake.loadgen.stamps` (when bytes went out and came in, kernel
timestamps), :mod:`~streamquake.loadgen.templates` (``${VAR}`` headers and path, redaction),
:mod:`~streamquake.loadgen.tally` (a stream's events into its sample).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import ssl
import time
from collections.abc import Callable, Mapping

import gevent
import gevent.socket
import gevent.ssl
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError, HTTPSocketResponse
from geventhttpclient.url import URL

from streamquake.jsontypes import compact_bytes
from streamquake.loadgen import self_measure, speedups
from streamquake.loadgen.conversation import Turn
from streamquake.loadgen.failures import _Cancelled, _Failed, _StreamTimeout
from streamquake.loadgen.heads import TRACEPARENT, HeadClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan, SlowRead
from streamquake.loadgen.reader import BACKLOG, Step, _Backlog
from streamquake.loadgen.reader import reader as _reader
from streamquake.loadgen.samples import ErrorKind, RequestSample
from streamquake.loadgen.sse_parser import SSEEvent, SSELimitError, SSELimits, SSEParser
from streamquake.loadgen.stamps import (
    _BLOCK,
    _CONN,
    _FIRST_BYTE,
    _HEAD,
    _WRITTEN,
    _YIELD_S,
    Arrival,
    _HeadBudget,
    _instrument,
    _read_some,
    _StampedSSLSocket,
    head_bytes,
)
from streamquake.loadgen.tally import BURST_WAIT_MS, _Tally
from streamquake.loadgen.templates import Redactor, expand_headers, expand_path
from streamquake.loadgen.wire import build_request, join_path, protocol_headers
from streamquake.protocols import with_history

_ERROR_BODY_MAX = 4096
_DRAIN_S = 1.0          # after the terminal event, how long to wait for the HTTP body's end
_DRAIN_MAX = 1 << 20    # ... and how much of it to read before dropping the connection instead
_BACKLOG = _BLOCK // 2  # a read this big says the socket had more waiting
# Where a response keeps the compiled decoder of its body's framing while it has one
# (_Stream.hand_over), for the drain after the stream's final event.
_FAST = "sq_fast"
_DETAIL_MAX = 300       # characters of an error's reason kept in a sample
_ID_MAX = 128           # characters of a response id kept in a sample
# A slow consumer (a class's ``read.rate``) reads about this many seconds' worth at a time.
_PACE_S = 0.05
_PACE_MIN = 256


def _traceparent() -> tuple[str, str, str]:
    """A fresh W3C trace context: its trace id, span id, and the ``traceparent`` header's
    value (version 00, sampled). All-zero ids are invalid, so never drawn."""
    while True:
        raw = os.urandom(24)
        if any(raw[:16]) and any(raw[16:]):
            trace_id, span_id = raw[:16].hex(), raw[16:].hex()
            return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _tls_context_factory(verify: bool) -> Callable[..., ssl.SSLContext]:
    def factory(cafile: str | None = None, **_: object) -> ssl.SSLContext:
        # The system store honours SSL_CERT_FILE / SSL_CERT_DIR at call time, which is how a
        # private CA gets trusted; geventhttpclient's own bundle is added on top.
        # gevent's own context (what ssl.create_default_context builds, minus the stdlib
        # class): in a process gevent has not patched, the stdlib's sockets would read TLS in
        # blocking calls that stop every other greenlet.
        ctx: ssl.SSLContext = gevent.ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.sslsocket_class = _StampedSSLSocket
        ctx.load_default_certs()
        if cafile and os.path.isfile(cafile):
            ctx.load_verify_locations(cafile=cafile)
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return factory


MAX_EVENTS = 200_000
"""Events one stream may bring: a long answer is 30,000 tokens; past this the stream is an error
(``limit``), so that one that never ends costs bounded memory and a bounded sample line."""


class StreamClient:
    """Streams requests of one load plan over a connection pool of ``concurrency`` sockets."""

    def __init__(
        self,
        plan: LoadPlan,
        *,
        concurrency: int = 1,
        environ: Mapping[str, str] | None = None,
        limits: SSELimits | None = None,
        max_events: int = MAX_EVENTS,
    ) -> None:
        self.plan = plan
        self.limits = limits or SSELimits()
        self.max_events = max_events
        env = os.environ if environ is None else environ
        url = URL(plan.base_url)
        self._prefix = url.path.rstrip("/")
        user_headers = expand_headers(plan.headers, env)
        self._headers = {
            **protocol_headers(plan.protocol),
            # A compressed event stream cannot be timed event by event: ask for none, and
            # count one that comes anyway as its own error (unsupported_encoding).
            "Accept-Encoding": "identity",
            **user_headers,
        }
        self._path = expand_path(plan.path, env) if plan.path else None
        self.redact = Redactor.for_request(plan.headers, user_headers, plan.path or "",
                                           self._path or "", env)
        self._url, self._concurrency = url, concurrency
        self._http = self._pool(None)
        # A slow consumer's connections are its own (their receive buffer is set before the
        # connect): a pool per class ``read``, made on first use.
        self._pools: dict[SlowRead, HTTPClient] = {}

    def _pool(self, read: SlowRead | None) -> HTTPClient:
        http = HeadClient.from_url(
            self._url,
            concurrency=self._concurrency,
            connection_timeout=self.plan.connect_timeout_s,
            # No per-read timer (gevent would arm and cancel one on every read that waits): the
            # whole-stream deadline in measure() bounds every wait, writes included.
            network_timeout=None,
            ssl_context_factory=_tls_context_factory(self.plan.verify_tls),
            insecure=not self.plan.verify_tls,
            # The response head is read in blocks of this too: a slow consumer's are small.
            block_size=_BLOCK if read is None else _SlowReader.block(read),
        )
        # Its sockets are stamped by the kernel from the first byte (after_connect: a socket
        # enabled later gets no stamp for bytes already queued), tell when a request's last
        # byte was written (_StampedSocket), and time their resolve, connect and TLS (_Conn).
        _instrument(http._connection_pool, None if read is None else read.receive_buffer)
        return http

    def _pool_for(self, read: SlowRead | None) -> HTTPClient:
        if read is None:
            return self._http
        if read not in self._pools:
            self._pools[read] = self._pool(read)
        return self._pools[read]

    def close(self) -> None:
        self._http.close()
        for http in self._pools.values():
            http.close()

    def measure(
        self, cls: RequestClassPlan, rng: random.Random, scheduled: float | None = None,
        cancel: bool = False, turn: Turn | None = None,
    ) -> RequestSample:
        """Send one request of class ``cls`` now and follow its stream to the end.

        Always returns a sample: within the plan's timeout (checked between reads, so a socket
        that never runs dry cannot hold it), and with any credential redacted from its reason.
        ``cancel``: this is one of the streams its class's ``cancel`` abandons: the client
        closes the connection at that point, and the sample says ``cancelled``. ``turn``: a
        conversation's turn: its history is the request's messages, and its ``answer`` is set
        to the text received.
        """
        path, body = build_request(self.plan.protocol, self.plan.model, cls, rng, self._path)
        if turn is not None:
            body = with_history(self.plan.protocol, body, turn.system, turn.history,
                                turn.prompt)
        uri = join_path(self._prefix, self._path or path)
        payload = compact_bytes(body)
        trace_id, span_id, traceparent = _traceparent()     # fresh per attempt
        headers = {**self._headers, TRACEPARENT: traceparent}
        sample = RequestSample(cls=cls.name, sent=time.time(), scheduled=scheduled,
                               trace_id=trace_id, span_id=span_id)
        t0 = time.perf_counter()
        setattr(gevent.getcurrent(), _WRITTEN, None)
        setattr(gevent.getcurrent(), _CONN, None)
        setattr(gevent.getcurrent(), _FIRST_BYTE, None)
        deadline_at = t0 + self.plan.timeout_s
        tally = _Tally(sample, self.plan, t0, self.max_events, self_measure.active())
        if turn is not None:
            sample.turn, tally.answer = turn.number, []
        resp: HTTPSocketResponse | None = None
        deadline = gevent.Timeout(self.plan.timeout_s, _StreamTimeout())
        deadline.start()
        abandon = _Abandon(cls, t0) if cancel and cls.cancel is not None else None
        self_measure.IN_FLIGHT[0] += 1      # the live view's "in flight" (self_measure.py)
        try:
            try:
                resp = self._open(self._pool_for(cls.read), uri, payload, headers, tally,
                                  deadline_at)
                slow = None if cls.read is None else _SlowReader(cls.read, tally)
                end = self._follow(resp, tally, deadline_at, slow, abandon)
            except _Cancelled:
                # The client closed it (below: an unfinished body's socket is closed, not
                # pooled): the server sees the connection go, as a closed browser tab does.
                end = time.perf_counter()
                sample.cancelled = True
            except _Failed as exc:
                end = time.perf_counter()
                sample.error, sample.error_detail = exc.kind, exc.detail
            except _StreamTimeout:
                end = time.perf_counter()
                sample.error = "timeout"
                sample.error_detail = (
                    f"no complete stream within {self.plan.timeout_s:g} s"
                    + (" (no response headers)" if sample.ttfb_ms is None else
                       " (it went silent mid-answer)" if tally.silent(end) else "")
                )
            finally:
                deadline.cancel()
                if abandon is not None:
                    abandon.timer.cancel()
                tally.dated(t0)     # a request that failed after its write: timed from it
            if resp is not None and tally.done:
                _drain(resp)
        finally:
            self_measure.IN_FLIGHT[0] -= 1
            # Also on GreenletExit (Locust stopping a user): never leak the socket.
            if resp is not None:
                resp.release()
        if sample.error_detail is not None:
            sample.error_detail = self.redact(sample.error_detail)[:_DETAIL_MAX]
        # Whatever the server put in these: redacted whole, then cut.
        if sample.response_id is not None:
            sample.response_id = _printable(self.redact(sample.response_id), _ID_MAX)
        if sample.model is not None:
            sample.model = _printable(self.redact(sample.model), _ID_MAX)
        if sample.finish_reason is not None:
            sample.finish_reason = _printable(self.redact(sample.finish_reason), 40)
        if turn is not None and tally.answer is not None:
            turn.answer = "".join(tally.answer)
        return tally.finish(end)

    def _open(
        self, http: HTTPClient, uri: str, payload: bytes, headers: dict[str, str],
        tally: _Tally, deadline: float
    ) -> HTTPSocketResponse:
        sample, t0 = tally.sample, tally.t0
        me = gevent.getcurrent()
        setattr(me, _HEAD, _HeadBudget(deadline))
        try:
            resp = http.request("POST", uri, body=payload, headers=headers)
        except (OSError, HTTPParseError) as exc:
            raise _Failed(*_before_response(exc, self.plan.connect_timeout_s)) from exc
        finally:
            setattr(me, _HEAD, None)
        headers_at = time.perf_counter()
        tally.dated(t0)
        tally.first_byte(headers_at)
        sample.status = resp.status_code
        if not 200 <= resp.status_code < 300:
            detail = _status_detail(resp, deadline)
            resp.release()
            raise _Failed("http_status", detail)
        ctype = resp.get("content-type")
        if not isinstance(ctype, str) or "text/event-stream" not in ctype.lower():
            got = (f"Content-Type {_printable(ctype, _ERROR_BODY_MAX)}"
                   if isinstance(ctype, str) else "no Content-Type")
            first = _first_bytes(resp, deadline)
            resp.release()
            raise _Failed("content_type", f"HTTP {resp.status_code} with {got}, not "
                                          "text/event-stream: the target did not stream"
                                          + (f"; it began {first}" if first else ""))
        encoding = resp.get("content-encoding")
        if isinstance(encoding, str) and encoding.strip().lower() not in ("", "identity"):
            resp.release()
            raise _Failed("unsupported_encoding",
                          f"the event stream is {_printable(encoding, _ERROR_BODY_MAX)}-encoded "
                          "(Content-Encoding), though the request asked for identity: "
                          "streamquake times uncompressed streams only")
        return resp

    def _follow(self, resp: HTTPSocketResponse, tally: _Tally, deadline: float,
                slow: _SlowReader | None = None, abandon: _Abandon | None = None) -> float:
        """Feed the stream to ``tally`` until its terminal event; return when it arrived. A
        plain-TCP stream read at full speed is read by the hub's shared reader
        (:mod:`~streamquake.loadgen.reader`) while this greenlet waits; any other (TLS, a
        ``slow`` consumer) by this greenlet. A slow consumer reads small blocks at its own
        pace, and times each event when it read it, not when the kernel had it (that is what
        this consumer saw)."""
        # Bytes that came with the headers are timed as they are (TTFB: the first byte).
        arrival = Arrival(resp._sock if slow is None else None,
                          time.perf_counter() if tally.headers_at is None else tally.headers_at)
        follow = _Stream(resp, tally, SSEParser(self.limits), arrival, deadline, abandon)
        sock = resp._sock
        shared = _reader() if slow is None and arrival.plain else None
        try:
            if shared is not None and sock is not None:
                follow.hand_over(sock)
                if resp._body_buffer:       # bytes read with the headers
                    arrival.buffered()
                    end = follow.chunk(follow.take())
                    if end is not None:
                        return end
                end = follow.ended() if resp.message_complete else None
                if end is not None:
                    return end
                step = follow.stepper()
                try:
                    return shared.follow(sock.fileno(), step)
                finally:
                    # The compiled step holds the stream's state while it folds its reads:
                    # the sample, tally and arrival are theirs again from here.
                    if (flush := getattr(step, "flush", None)) is not None:
                        flush()
            return self._read_own(follow, slow)
        except SSELimitError as exc:
            raise _Failed("limit", str(exc)) from exc
        except (HTTPConnectionClosed, OSError) as exc:
            raise _Failed("truncated", f"the stream broke off: {_oserror_text(exc)}") from exc
        except HTTPParseError as exc:
            raise _Failed("protocol",
                          f"invalid HTTP framing of the body: {_parse_error_text(exc)}") from exc

    @staticmethod
    def _read_own(follow: _Stream, slow: _SlowReader | None) -> float:
        """This greenlet reads the stream itself (TLS, a slow consumer)."""
        resp, arrival = follow.resp, follow.arrival
        size = _BLOCK if slow is None else slow.size
        next_yield = time.perf_counter() + _YIELD_S
        while True:
            chunk = _read_some(resp, follow.deadline, arrival, size)
            end = follow.chunk(chunk)
            if end is not None:
                return end
            if slow is not None:
                slow.pace(len(chunk), follow.last_events)
            if len(chunk) >= _BACKLOG and arrival.seen >= next_yield:
                # A socket that always has data never blocks, so no other user (nor Locust's
                # own timers) would run: a backlog of a full read yields, every _YIELD_S,
                # until the loop has polled I/O.
                gevent.idle()
                next_yield = time.perf_counter() + _YIELD_S


class _Stream:
    """One stream's reading: its bytes into SSE events, its events into its tally, whoever
    reads it (its own greenlet, or the hub's shared reader, a read at a time: ``step``)."""

    __slots__ = ("resp", "tally", "parser", "arrival", "deadline", "abandon", "kernel_reads",
                 "user_reads", "last_events", "fast", "fd")

    def __init__(self, resp: HTTPSocketResponse, tally: _Tally, parser: SSEParser,
                 arrival: Arrival, deadline: float, abandon: _Abandon | None) -> None:
        self.resp, self.tally, self.parser, self.arrival = resp, tally, parser, arrival
        self.deadline, self.abandon = deadline, abandon
        self.kernel_reads = self.user_reads = self.last_events = 0
        self.fast: speedups.ChunkedBody | None = None
        self.fd = -1

    def hand_over(self, sock: gevent.socket.socket) -> None:
        """A chunked body's framing decoded with each read by the compiled part
        (``speedups.Chunked``), from where the HTTP parser stands after the head's reads: the
        body bytes those reads brought are decoded first, and must give what the parser gave
        (else the parser keeps the body). The compiled part hands the body back to the
        parser at the last chunk, or at any size line that is not of the plain kind; so the
        parser still judges those, and ends the message (the connection's reuse is its call).
        Nothing where the compiled part is not built."""
        resp = self.resp
        if speedups.Chunked is None or resp.message_complete \
                or resp.get("content-length") is not None:
            return
        coding = resp.get("transfer-encoding")
        raw = head_bytes(sock)
        if not (isinstance(coding, str) and coding.strip().lower() == "chunked") \
                or raw is None or raw.startswith(b"HTTP/1.1 1"):      # an interim response too
            return
        end = raw.find(b"\r\n\r\n")
        if end < 0:
            return
        fast = speedups.Chunked()
        try:
            body, rest = fast.feed(raw[end + 4:])
        except ValueError:
            return
        if rest is None and body == resp._body_buffer:
            self.fast, self.fd = fast, sock.fileno()
            setattr(resp, _FAST, fast)

    def take(self) -> bytes:
        """The body bytes the HTTP parser holds, taken out of its buffer."""
        buf = self.resp._body_buffer
        out = bytes(buf)
        del buf[:]
        return out

    def ended(self) -> float | None:
        """The body ended: complete if its protocol may end so, else truncated (raised)."""
        tally = self.tally
        if tally.ends_with_body and tally.sample.finish_reason is not None:
            tally.complete()     # its server sends no terminal event (transformers)
            return self.arrival.at
        raise _Failed("truncated", "the stream ended before the protocol's final event")

    def step(self) -> float | _Backlog | None:
        """One read of a socket that epoll says is ready, in the hub (``reader.Reader``):
        what ``_read_some`` does for one ``recv``, without waiting; BACKLOG after a read that
        took a whole block. Raises BlockingIOError when there was nothing after all."""
        resp = self.resp
        sock = resp._sock
        if sock is None:
            raise HTTPConnectionClosed("connection closed")
        if self.fast is not None:
            return self._step_fast(self.fast)
        data = self.arrival.recv_ready(sock._sock, _BLOCK)   # the plain socket: never waits
        if not data:
            # The peer closed: that ends a body without framing, and cuts any other short.
            with contextlib.suppress(HTTPParseError):
                resp.feed(data)
            if not resp.message_complete:
                raise HTTPConnectionClosed("connection closed")
        else:
            resp.feed(data)   # broken framing (an invalid chunk size, say) raises HTTPParseError
        if resp._body_buffer:
            end = self.chunk(self.take())
            if end is not None:
                return end
        elif self.arrival.seen > self.deadline:
            raise _StreamTimeout()
        if resp.message_complete:
            return self.ended()
        return BACKLOG if len(data) >= _BLOCK else None

    def _step_fast(self, fast: speedups.ChunkedBody) -> float | _Backlog | None:
        """:meth:`step` with the body's framing decoded by the compiled part (hand_over)."""
        try:
            body, seen, lag, nraw, rest = fast.read(self.fd)
        except ValueError as exc:       # chunk data not ended by CRLF, in llhttp's words
            raise HTTPParseError(*exc.args) from None
        return self._step_read(body, seen, lag, nraw, rest)

    def _step_read(self, body: bytes, seen: float, lag: float, nraw: int, rest: bytes | None
                   ) -> float | _Backlog | None:
        """:meth:`_step_fast` after its read (``Chunked.read``'s answer); also where
        ``speedups.FramedStep`` hands every read it does not fold in itself."""
        resp = self.resp
        self.arrival.stamped(seen, lag)
        if rest is not None:
            # The parser's from this size line on (the last chunk's, or one not plain).
            self.fast = None
            _give_back(resp, rest)      # broken framing raises HTTPParseError, as in step
            if resp._body_buffer:
                body += self.take()
        elif not nraw:
            raise HTTPConnectionClosed("connection closed")     # the peer closed mid-body
        if body:
            end = self.chunk(body)
            if end is not None:
                return end
        elif seen > self.deadline:
            raise _StreamTimeout()
        if resp.message_complete:
            return self.ended()
        return BACKLOG if nraw >= _BLOCK else None

    def stepper(self) -> Step:
        """What the shared reader calls for each read of this stream: :meth:`step`, or where
        the body's framing is decoded by the compiled part (hand_over), its twin
        ``speedups.FramedStep``, which folds a read of template events only in C, as
        :meth:`_step_read` would (tests/test_framed_step.py holds the two equal), and hands
        every other read to :meth:`_step_read`."""
        if self.fast is None or speedups.FramedStep is None:
            return self.step
        return speedups.FramedStep(self, BACKLOG, HTTPParseError, BURST_WAIT_MS,
                                   float(self_measure.SEEN_BUCKETS_PER_E))

    def chunk(self, chunk: bytes) -> float | None:
        """Fold one read's body bytes (b"": the body ended) into the tally; when the stream's
        terminal event came, return when it arrived."""
        if not chunk:
            return self.ended()
        tally, arrival = self.tally, self.arrival
        now = arrival.seen
        tally.sample.body_bytes += len(chunk)
        # The commonest read of all, one or more events that are the stream's template around
        # new text, is known as such by its bytes alone (PlainTemplate.framed): no event is
        # split out of it, nor parsed, and it is folded in as a whole (_Tally.add_framed); so
        # is such a read's run of them before its other events (the closing ones, say),
        # which go on as any read does from there. Other plain answer text, as nearly every
        # other read of a stream is, is folded in as a whole too (_Tally.add_plain); anything
        # else event by event, below.
        template = tally._plain
        shortcut = self.abandon is None and not arrival.with_headers
        events: list[SSEEvent] = []
        folded = 0
        if shortcut and template is not None:
            count, end = template.framed(chunk)
            if (count and self.parser.clean(end)
                    and tally.add_framed(count, self.parser.last_id, arrival.at, now)):
                folded, chunk = count, chunk[end:]
        if not chunk:
            self.last_events = folded
        elif (shortcut and (plain := self.parser.plain(chunk)) is not None
                and tally.add_plain(plain, arrival.at, now)):
            self.parser.took(plain)
            self.last_events = folded + len(plain)
        else:
            events = self.parser.feed(chunk)
            self.last_events = folded + len(events)
        if self.last_events and not arrival.with_headers:
            self._clock(self.last_events)
        abandon = self.abandon
        for event in events:
            tally.add(event, arrival.at, now, arrival.kernel, arrival.with_headers)
            if tally.done:
                return arrival.at
            if abandon is not None:
                abandon.check(tally.sample.content_events, now)
        # A socket that always has data never blocks, so the gevent timeout never fires: the
        # deadline is checked here too.
        if now > self.deadline:
            raise _StreamTimeout()
        return None

    def _clock(self, events: int) -> None:
        """A read off the socket (not the headers') brought ``events``: the stream's clock,
        "kernel" while every such read had a stamp (bytes that came with the headers are timed
        at the headers, as TTFB is), and the guard's account of the load process's lateness."""
        tally, arrival = self.tally, self.arrival
        guard = tally.guard
        # The clock is "kernel" from the first stamped read for as long as no read lacks one.
        if arrival.kernel:
            self.kernel_reads += 1
            if guard is not None:
                guard.seen(arrival.seen - arrival.at, events)
            if self.kernel_reads == 1 and not self.user_reads:
                tally.sample.clock = "kernel"
        else:
            self.user_reads += 1
            if guard is not None:
                guard.user_read()
            tally.sample.clock = "user"


class _Abandon:
    """Where the client abandons one stream (its class's ``cancel``): at its ``after_tokens``-th
    content event, or ``after_s`` from the attempt's start, as from a user's click (a timer for
    the waits, and a check between events for a stream that never lets it fire); raises
    _Cancelled there."""

    def __init__(self, cls: RequestClassPlan, t0: float) -> None:
        cancel = cls.cancel
        assert cancel is not None
        self.tokens = cancel.after_tokens
        self.after_s = cancel.after_s
        self.at = None if self.after_s is None else t0 + self.after_s
        self.timer = gevent.Timeout(self.after_s, _Cancelled())
        if self.after_s is not None:
            self.timer.start()

    def check(self, content_events: int, now: float) -> None:
        if self.tokens is not None and content_events >= self.tokens:
            raise _Cancelled()
        if self.at is not None and now >= self.at:
            raise _Cancelled()


class _SlowReader:
    """A slow consumer's pace (a class's ``read``): after each read, wait (gevent.sleep: every
    other greenlet runs meanwhile) until its body bytes so far fit its byte rate, and pause
    ``pause_s`` for every ``pause_every`` events read (one read of 20 events, every 10: two
    pauses in one)."""

    def __init__(self, read: SlowRead, tally: _Tally) -> None:
        self.read = read
        self.size = self.block(read)
        self.start = time.perf_counter()
        self.taken = 0
        self.events = 0
        tally.paced = True

    @staticmethod
    def block(read: SlowRead) -> int:
        """Bytes one read may take: about _PACE_S seconds' worth at its byte rate, else (a
        pausing reader) _PACE_MIN, an event or two, so that its pauses fall between events."""
        if read.rate_bytes_per_s is not None:
            return int(min(_BLOCK, max(_PACE_MIN, read.rate_bytes_per_s * _PACE_S)))
        return _PACE_MIN if read.pause_s else _BLOCK

    def pace(self, nbytes: int, events: int) -> None:
        now = time.perf_counter()
        until = now
        rate = self.read.rate_bytes_per_s
        if rate is not None:
            self.taken += nbytes
            until = max(now, self.start + self.taken / rate)
        self.events += events
        pauses, self.events = divmod(self.events, self.read.pause_every)
        if self.read.pause_s and pauses:
            until += pauses * self.read.pause_s
            self.start += pauses * self.read.pause_s   # not made up for by reading faster
        if until > now:
            gevent.sleep(until - now)


def _give_back(resp: HTTPSocketResponse, rest: bytes) -> None:
    """The compiled part hands the body back to the HTTP parser: the bytes from the size line
    where the plain framing ended (hand_over), and every read after them."""
    setattr(resp, _FAST, None)
    resp.feed(rest)


def _drain(resp: HTTPSocketResponse) -> None:
    """Read to the end of the HTTP body, briefly and boundedly, so that its connection can be
    reused; a body that does not end soon is left unread, and the connection dropped."""
    until = time.perf_counter() + _DRAIN_S
    left = _DRAIN_MAX
    with gevent.Timeout(_DRAIN_S, False):
        try:
            fast: speedups.ChunkedBody | None = getattr(resp, _FAST, None)
            while fast is not None and left > 0:
                # The compiled part decodes the body's framing (_Stream.hand_over) until it
                # hands the body's end over to the parser.
                sock = resp._sock
                if sock is None:
                    return
                try:
                    _body, _seen, _lag, nraw, rest = fast.read(sock.fileno())
                except BlockingIOError:
                    gevent.socket.wait_read(sock.fileno(), max(0.0, until - time.perf_counter()))
                    continue
                if rest is not None:
                    fast = None
                    _give_back(resp, rest)
                elif not nraw or time.perf_counter() > until:
                    return
                left -= nraw
            while left > 0:
                chunk = _read_some(resp, until)
                if not chunk:
                    return
                left -= len(chunk)
                if time.perf_counter() > until:
                    return
        except (_StreamTimeout, OSError, HTTPParseError, ValueError):
            pass


def _before_response(exc: BaseException, connect_timeout_s: float) -> tuple[ErrorKind, str]:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "tls", (f"certificate verify failed: {exc.verify_message or exc.reason} "
                       "(verify_tls: false skips the check; SSL_CERT_FILE trusts a private CA)")
    if isinstance(exc, ssl.SSLError):
        reason = str(exc.reason or exc).replace("_", " ").lower()
        return "tls", f"TLS handshake failed: {reason}"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "connect", f"no connection within {connect_timeout_s:g} s"
    if isinstance(exc, socket.gaierror):
        return "connect", f"cannot resolve the host: {exc.strerror}"
    if isinstance(exc, HTTPConnectionClosed | ConnectionResetError | BrokenPipeError):
        return "connect", "the server closed the connection before answering"
    if isinstance(exc, HTTPParseError):
        return "protocol", f"invalid HTTP response: {_parse_error_text(exc)}"
    return "connect", _oserror_text(exc)


def _parse_error_text(exc: HTTPParseError) -> str:
    # llhttp's errors come as (message, code).
    first = exc.args[0] if exc.args else None
    return first if isinstance(first, str) and first else str(exc) or type(exc).__name__


def _oserror_text(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _printable(text: str, limit: int = 80) -> str:
    if len(text) <= limit and text.isprintable():
        return text         # nearly every id and model name: no copy a character at a time
    cleaned = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return cleaned + ("..." if len(text) > limit else "")


def _status_detail(resp: HTTPSocketResponse, deadline: float) -> str:
    """``HTTP 429 (Retry-After: 2): message``; a redirect names where it points. Nothing is
    cut short here: the caller redacts the whole reason first."""
    status = resp.status_code
    detail = f"HTTP {status}"
    retry_after = resp.get("retry-after")
    if isinstance(retry_after, str):
        detail += f" (Retry-After: {_printable(retry_after, _ERROR_BODY_MAX)})"
    if 300 <= status < 400:
        location = resp.get("location")
        where = f" to {_printable(location, _ERROR_BODY_MAX)}" if isinstance(location, str) \
            else ""
        return (f"{detail}: redirected{where}; streamquake does not follow redirects (give the "
                "final URL as target.url)")
    return detail + _error_message(resp, deadline)


def _error_message(resp: HTTPSocketResponse, deadline: float) -> str:
    """``": message"`` from an error body, or "" when there is none to read. Reads the common
    shapes: ``{"error": {"message": ...}}`` (OpenAI, Anthropic, Gemini), ``{"error": "..."}``,
    ``{"message": ...}``, FastAPI's ``{"detail": "..."}`` or ``{"detail": [{"msg": ...}]}``, and
    a plain-text body. Not shortened here: the caller redacts the whole reason, then cuts it."""
    try:
        raw = b""
        while len(raw) < _ERROR_BODY_MAX:
            chunk = _read_some(resp, deadline)
            if not chunk:
                break
            raw += chunk
    except (OSError, HTTPParseError, _StreamTimeout):
        # No readable message (a body that trickles past the deadline too): the status says it.
        return ""
    text = raw[:_ERROR_BODY_MAX].decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    message = _message_of(obj) if obj is not None else None
    if message is None:
        ctype = resp.get("content-type")
        html = isinstance(ctype, str) and "html" in ctype.lower()
        message = None if html else " ".join(text.split())   # an HTML page says nothing here
    return f": {_printable(message, _ERROR_BODY_MAX)}" if message else ""


def _first_bytes(resp: HTTPSocketResponse, deadline: float, limit: int = 120) -> str:
    """The start of a body that is not an event stream, as text, for the reason ("it began
    '<html><body>Welcome to nginx!'"); "" when none comes at once."""
    raw = b""
    with gevent.Timeout(_DRAIN_S, False), \
            contextlib.suppress(OSError, HTTPParseError, _StreamTimeout):
        while len(raw) < limit:
            chunk = _read_some(resp, min(deadline, time.perf_counter() + _DRAIN_S))
            if not chunk:
                break
            raw += chunk
    text = " ".join(raw[:limit].decode("utf-8", "replace").split())
    return repr(_printable(text, limit)) if text else ""


def _message_of(obj: object) -> str | None:
    if isinstance(obj, str):
        return obj or None
    if isinstance(obj, list):
        parts = [m for m in map(_message_of, obj[:5]) if m]
        return "; ".join(parts) or None
    if not isinstance(obj, dict):
        return None
    for key in ("error", "message", "detail", "msg", "title"):
        if key in obj and (found := _message_of(obj[key])):
            return found
    return None
