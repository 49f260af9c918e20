"""Measure one streaming request, timestamping every SSE event as its bytes come off the socket.

Runs under gevent (inside the Locust process, or any greenlet). geventhttpclient parses the
HTTP response, but its ``read()`` blocks for a whole block and Locust's ``iter_lines()`` hands
lines over late, so :func:`_read_some` takes whatever body bytes each ``recv`` brought.

Event times come from the kernel where it can say: plain TCP sockets get ``SO_TIMESTAMPNS``
at connect and are read with ``recvmsg``, whose ``SCM_TIMESTAMPNS`` says when the bytes came in,
whenever our greenlet got to them. For TCP that stamp is the arrival of the *latest* segment the
read returns (segments waiting in the receive queue are coalesced and keep the newest stamp),
so it never dates bytes before they arrived. TLS sockets cannot ``recvmsg`` (and their records
are decrypted in user space anyway): they, and any read the kernel gave no stamp, are timed
when our code saw them, and the sample says which clock it used (``clock``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import re
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import gevent
import gevent.socket
import gevent.ssl
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError, HTTPSocketResponse
from geventhttpclient.url import URL

from streamquake.envref import ENV_REF, is_env_name, not_a_name
from streamquake.errors import ScenarioError
from streamquake.loadgen import self_measure
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan, SlowRead
from streamquake.loadgen.samples import ErrorKind, RequestSample
from streamquake.loadgen.sse_parser import SSEEvent, SSELimitError, SSELimits, SSEParser
from streamquake.loadgen.wire import (
    ProtocolError,
    build_request,
    decoder,
    finish_required,
    join_path,
    protocol_headers,
)

_BLOCK = 64 * 1024
_ERROR_BODY_MAX = 4096
_DRAIN_S = 1.0          # after the terminal event, how long to wait for the HTTP body's end
_DRAIN_MAX = 1 << 20    # ... and how much of it to read before dropping the connection instead
_YIELD_S = 0.01         # a socket that never runs dry must still let other users run
_BACKLOG = _BLOCK // 2  # a read this big says the socket had more waiting
_DETAIL_MAX = 300       # characters of an error's reason kept in a sample
# What a header may hold (RFC 9110 field names and values; no CR, LF or NUL).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# Headers whose whole value is a credential, besides any value that came from ${VAR}.
_SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|signature|credential|password", re.I)
# Query parameters that carry credentials (Gemini's ``key=``, signed URLs, OAuth).
_SECRET_PARAM = re.compile(
    r"(?i)((?:^|[?&;\s\"'])(?:key|api[_-]?key|access[_-]?token|token|sig|signature|secret|"
    r"password|auth)=)([^&#\s\"'<>]+)")
_SECRET_MIN = 6         # shorter values would redact ordinary words
REDACTED = "[redacted]"
# Linux's value (asm-generic; x86, arm); Python 3.11 does not name it. With it set, a TCP
# socket's recvmsg carries SCM_TIMESTAMPNS (same number): a struct timespec, CLOCK_REALTIME.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_SOL_SOCKET = socket.SOL_SOCKET
_TIMESPEC = struct.Struct("@ll")
_CMSG_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)
_ID_MAX = 128           # characters of a response id kept in a sample
# Where the writing greenlet notes when its request's last byte was written (perf_counter s).
_WRITTEN = "sq_written"
# Where the greenlet that asked the pool for a socket notes how it got one (a _Conn).
_CONN = "sq_conn"
# A slow consumer (a class's ``read.rate``) reads about this many seconds' worth at a time.
_PACE_S = 0.05
_PACE_MIN = 256
# Test-only: hold every request write back this long (tests/test_send_stamp.py); unset in use.
_WRITE_HOLD_S = float(os.environ.get("STREAMQUAKE_TEST_WRITE_HOLD_MS") or 0) / 1000.0


def _note_written() -> None:
    setattr(gevent.getcurrent(), _WRITTEN, time.perf_counter())


class _WriteStamp:
    """Tells the greenlet writing on a pool socket when its write returned: a request is dated
    from its last byte written, not from when the client began to send it."""

    def sendall(self, data: object, flags: int = 0) -> None:
        if _WRITE_HOLD_S:
            gevent.sleep(_WRITE_HOLD_S)
        super().sendall(data, flags)  # type: ignore[misc]
        _note_written()


class _StampedSocket(_WriteStamp, gevent.socket.socket):  # type: ignore[misc]
    """A plain pool socket (the pool creates these); it also notes its connect (_Conn)."""

    def connect(self, address: object) -> None:
        conn = _conn()
        if conn is not None and conn.connect_start is None:
            conn.connect_start = time.perf_counter()   # the first address tried
        super().connect(address)
        if conn is not None:
            conn.connected = time.perf_counter()


class _StampedSSLSocket(_WriteStamp, gevent.ssl.SSLSocket):  # type: ignore[misc]
    """A TLS pool socket (the context wraps the TCP socket in this class)."""


@dataclass(slots=True)
class _Conn:
    """How the pool got one request its socket (perf_counter s): a name resolved, a TCP connect,
    a TLS handshake, or none of these (a pooled connection); ``ready`` when it handed it over."""

    dns_s: float | None = None
    connect_start: float | None = None
    connected: float | None = None
    handshaken: float | None = None
    ready: float | None = None

    def parts(self, s: RequestSample, written: float) -> None:
        """``send_ms`` in parts, on a request whose last byte was ``written``."""
        s.reused = self.connect_start is None
        if self.dns_s is not None:
            s.dns_ms = self.dns_s * 1000.0
        if self.connect_start is not None and self.connected is not None:
            s.connect_ms = (self.connected - self.connect_start) * 1000.0
            if self.handshaken is not None:
                s.tls_ms = (self.handshaken - self.connected) * 1000.0
        if self.ready is not None:
            s.write_ms = (written - self.ready) * 1000.0


def _conn() -> _Conn | None:
    conn: _Conn | None = getattr(gevent.getcurrent(), _CONN, None)
    return conn


def _after_connect(sock: socket.socket) -> None:
    """The pool's hook on each new connection, once it is connected (and its TLS handshake
    done: the context wraps the socket with ``do_handshake_on_connect``)."""
    enable_kernel_timestamps(sock)
    conn = _conn()
    if conn is not None and _is_tls(sock):
        conn.handshaken = time.perf_counter()


def _instrument(pool: Any, receive_buffer: int | None) -> None:
    """Time the steps of geventhttpclient's ConnectionPool on the greenlet that asks it for a
    socket (get_socket -> _resolve -> _create_tcp_socket -> connect -> TLS -> after_connect),
    through the pool's own hooks and methods."""
    get_socket, resolve = pool.get_socket, pool._resolve
    try:
        ipaddress.ip_address(pool._connection_host.strip("[]"))
        named = False            # an IP address: nothing to resolve (getaddrinfo just parses it)
    except ValueError:
        named = True

    def timed_get_socket() -> object:
        conn = _Conn()
        setattr(gevent.getcurrent(), _CONN, conn)
        sock = get_socket()
        conn.ready = time.perf_counter()
        return sock

    def timed_resolve() -> object:
        start = time.perf_counter()
        infos = resolve()
        if named and (conn := _conn()) is not None:
            conn.dns_s = time.perf_counter() - start
        return infos

    def create_tcp_socket(family: int, socktype: int, proto: int) -> _StampedSocket:
        sock = _StampedSocket(family, socktype, proto)
        if receive_buffer is not None:
            # Before the connect: the window the handshake offers comes from it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        return sock

    for name, hook in (("get_socket", timed_get_socket), ("_resolve", timed_resolve),
                       ("_create_tcp_socket", create_tcp_socket),
                       ("after_connect", _after_connect)):
        setattr(pool, name, hook)


def _traceparent() -> tuple[str, str]:
    """A fresh W3C trace context: its trace id, and the ``traceparent`` header's value
    (version 00, a new span id, sampled). All-zero ids are invalid, so never drawn."""
    while True:
        raw = os.urandom(24)
        if any(raw[:16]) and any(raw[16:]):
            trace_id = raw[:16].hex()
            return trace_id, f"00-{trace_id}-{raw[16:].hex()}-01"


class _StreamTimeout(Exception):
    """The whole-stream deadline (plan.timeout_s) passed."""


class _Failed(Exception):
    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.kind: ErrorKind = kind
        self.detail = detail


def expand_headers(headers: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Replace ``${VAR}`` in header values from ``environ``; name the variable if it is unset.

    Error messages name headers and variables, never a value.
    """
    missing: list[str] = []
    out: dict[str, str] = {}
    for name, value in headers.items():
        expanded = _expand(value, environ, f"header {name!r}", missing)
        if not _HEADER_NAME.fullmatch(name):
            missing.append(f"header name {name!r} is not a valid HTTP header name")
        elif not _HEADER_VALUE.fullmatch(expanded):
            refs = ", ".join(f"${{{v}}}" for v in ENV_REF.findall(value))
            source = f" (after expanding {refs})" if refs else ""
            missing.append(f"header {name!r} holds a line break or another control character"
                           f"{source}: an HTTP header cannot carry it")
        out[name] = expanded
    if missing:
        raise ScenarioError(missing)
    return out


def expand_path(path: str, environ: Mapping[str, str]) -> str:
    """``${VAR}`` in the request path (e.g. Gemini's ``?key=${GEMINI_API_KEY}``), so that a key
    given in the URL is never written to disk either."""
    missing: list[str] = []
    out = _expand(path, environ, "the request path", missing)
    if missing:
        raise ScenarioError(missing)
    return out


def check_templates(plan: LoadPlan, environ: Mapping[str, str]) -> None:
    """Raise ScenarioError if a header or the path names a variable ``environ`` lacks."""
    expand_headers(plan.headers, environ)
    if plan.path:
        expand_path(plan.path, environ)


def _expand(text: str, environ: Mapping[str, str], what: str, missing: list[str]) -> str:
    def repl(m: re.Match[str]) -> str:
        var = m.group(1)
        if not is_env_name(var):
            missing.append(f"{what}: {not_a_name(var)}")
            return ""
        if var not in environ:
            missing.append(f"{what} uses ${{{var}}}, but {var} is not set in the environment "
                           "of the load process: export it before the run")
            return ""
        return environ[var]
    return ENV_REF.sub(repl, text)


class Redactor:
    """Removes credentials from text the load process writes (error reasons, logs): every
    value that came from ``${VAR}``, whole values of credential headers (and their token after
    ``Bearer``), and any ``key=``-style query parameter, even one the target made up."""

    def __init__(self, secrets: Iterable[str]) -> None:
        found = sorted({s for s in secrets if len(s) >= _SECRET_MIN}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, found))) if found else None

    @classmethod
    def for_request(cls, templates: Mapping[str, str], headers: Mapping[str, str],
                    path_template: str, path: str, environ: Mapping[str, str]) -> Redactor:
        secrets: list[str] = []
        for name, template in templates.items():
            value = headers.get(name, "")
            if _SECRET_HEADER.search(name) or ENV_REF.search(template):
                scheme, _, token = value.partition(" ")    # "Bearer sk-...", "Basic ..."
                secrets += [value, token.strip()] if token.strip() else [value]
        for text in (*templates.values(), path_template):
            secrets += [environ.get(var, "") for var in ENV_REF.findall(text)]
        secrets += [m.group(2) for m in _SECRET_PARAM.finditer(path)]
        return cls(secrets)

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(REDACTED, text)
        return _SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text)


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


def _is_tls(sock: object) -> bool:
    return isinstance(sock, gevent.ssl.SSLSocket | ssl.SSLSocket)


def enable_kernel_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp what this socket receives from now on (bytes already queued get
    no stamp); False where it cannot (TLS, another OS)."""
    if _is_tls(sock):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


class Arrival:
    """When the body bytes of the latest read arrived (``at``) and when our code saw them
    (``seen``), both perf_counter seconds; ``kernel`` says whether ``at`` came from the kernel.

    ``at`` never goes back: not before the previous read's, nor before the response headers
    were seen (``floor``), so that a stream's times stay ordered whatever the wall clock does.
    ``with_headers``: the latest bytes came in the headers' read (timed at the headers).
    """

    __slots__ = ("at", "seen", "kernel", "with_headers", "_plain")

    def __init__(self, sock: object, floor: float) -> None:
        self.at = self.seen = floor
        self.kernel = self.with_headers = False
        self._plain = sock is not None and not _is_tls(sock)

    def buffered(self) -> None:
        """Bytes the HTTP parser already held came in the headers' read: they arrived by the
        time the headers were seen (``at`` stays there), and no kernel stamp says when."""
        self.seen = time.perf_counter()
        self.kernel, self.with_headers = False, True

    def recv(self, sock: socket.socket, size: int = _BLOCK) -> bytes:
        stamp: float | None = None
        data: bytes
        if self._plain:
            data, ancillary, _flags, _addr = sock.recvmsg(size, _CMSG_BYTES)
            if ancillary:       # room for one message: the stamp, when there is one
                level, kind, raw = ancillary[0]
                if kind == SO_TIMESTAMPNS and level == _SOL_SOCKET:
                    sec, nsec = _TIMESPEC.unpack_from(raw)
                    stamp = sec + nsec * 1e-9
        else:
            data = sock.recv(size)
        seen = time.perf_counter()
        self.seen, self.with_headers = seen, False
        if stamp is None:
            self.at, self.kernel = max(self.at, seen), False
        else:
            # The stamp is CLOCK_REALTIME: carry its distance from now over to perf_counter.
            self.at = max(self.at, seen - max(0.0, time.time() - stamp))
            self.kernel = True
        return data


def _read_some(resp: HTTPSocketResponse, deadline: float, arrival: Arrival | None = None,
               size: int = _BLOCK) -> bytes:
    """Body bytes available now, after at most one ``recv`` (of at most ``size`` bytes) that
    brings some; b"" once the body has ended. Raises _StreamTimeout past ``deadline``
    (perf_counter seconds) even while the socket keeps delivering bytes that carry no body
    (chunk framing, say). ``arrival``, if given, is told when the returned bytes arrived.

    Uses the response's parser buffer and socket directly: the public ``read(n)`` waits for
    ``n`` bytes, which would hold early events back until later ones arrive.
    """
    buf = resp._body_buffer
    if buf and arrival is not None:
        arrival.buffered()
    while not buf:
        if resp.message_complete:
            return b""
        sock = resp._sock
        if sock is None:
            raise HTTPConnectionClosed("connection closed")
        data = sock.recv(size) if arrival is None else arrival.recv(sock, size)
        if not data:
            # The peer closed: that ends a body without framing, and cuts any other short.
            with contextlib.suppress(HTTPParseError):
                resp.feed(data)
            if not resp.message_complete:
                raise HTTPConnectionClosed("connection closed")
            break
        resp.feed(data)   # broken framing (an invalid chunk size, say) raises HTTPParseError
        if not buf and time.perf_counter() > deadline:
            raise _StreamTimeout()
    out = bytes(buf)
    del buf[:]
    return out


BURST_WAIT_MS = 50.0
"""A read that brings several content events this long or longer after the stream's previous
content (or, with the response headers, after the request) brought a burst: they were held back
on the way and released together, in lumps a reader sees (RequestSample.bunched). Events that
a fast server sends sub-millisecond apart share reads too, but after no such wait."""


class _Tally:
    """Folds a stream's events into a RequestSample as they arrive.

    A gap over the stall threshold is the server's (``stalls``) only when the bytes really came
    that late: when the kernel's stamps say they came in time, or (without stamps) the gap less
    the time the gevent hub was running late within it is under the threshold, the stall was
    the load process's own and is counted apart (``client_stalls``). So is every such gap of a
    slow consumer (``paced``): its own pauses make them.
    """

    paced = False

    def __init__(self, sample: RequestSample, plan: LoadPlan, t0: float,
                 max_events: int, guard: self_measure.Guard | None = None) -> None:
        self.sample = sample
        self.protocol = plan.protocol
        self._decode = decoder(plan.protocol)
        self.finish_required = finish_required(plan.protocol)
        self.stall_s = plan.stall_threshold_ms / 1000.0
        self.t0 = t0
        self.guard = guard
        self.last_text_at: float | None = None
        self.last_text_seen = t0
        self.read_events = 0            # content events in the latest read that brought some
        self.read_held = False          # ... which came after a wait of BURST_WAIT_MS or more
        self.first_read_events = 0      # the first such read's, until a later one is a burst
        self.ids: set[int] = set()
        self.max_events = max_events
        self.events_left = max_events
        self.done = False

    def dated(self, t0: float) -> None:
        """Date the request from its last byte written, if this greenlet wrote it since the
        attempt began at ``t0``: TTFB, TTFT and E2E count from there, and the time before it
        (pool, connect, write) is ``send_ms``."""
        s = self.sample
        written = getattr(gevent.getcurrent(), _WRITTEN, None)
        if s.send_ms is not None or written is None or written < t0:
            return
        s.send_ms = (written - t0) * 1000.0
        s.sent += written - t0
        self.t0 = written
        if (conn := _conn()) is not None:
            conn.parts(s, written)

    def add(self, event: SSEEvent, now: float, seen: float | None = None,
            kernel: bool = False, with_headers: bool = False) -> None:
        """``now``: when the event's bytes arrived; ``seen``: when our code saw them (default:
        the same); ``kernel``: ``now`` is the kernel's receive stamp; ``with_headers``: the
        bytes came in the response headers' read."""
        s = self.sample
        seen = now if seen is None else seen
        self.events_left -= 1
        if self.events_left < 0:
            # Every event adds to the sample (an ITL, an id): a stream that never ends must
            # not grow the load process, or a sample line, without bound.
            raise _Failed("limit", f"more than {self.max_events:,} events in one stream "
                                   "(the client's event limit)")
        if event.id is not None and len(event.id) <= 18 and event.id.isdigit():
            self.ids.add(int(event.id))
        try:
            d = self._decode(event)
        except ProtocolError as exc:
            raise _Failed("protocol", str(exc)) from exc
        if d.usage_output_tokens is not None:
            s.usage_tokens = d.usage_output_tokens
        if d.response_id is not None and s.response_id is None:
            s.response_id = d.response_id
        if d.model is not None and s.model is None:
            s.model = d.model
        if d.finish is not None:
            s.finish_reason = d.finish
        if d.text:
            s.content_events += 1
            self._count_read(now, seen, with_headers)
            if self.last_text_at is None:
                s.ttft_ms = (now - self.t0) * 1000.0
            else:
                gap = now - self.last_text_at
                s.itl_ms.append(gap * 1000.0)
                if gap == 0.0:
                    s.shared_stamps += 1     # read with the one before: one stamp for both
                if gap > self.stall_s:
                    if kernel or self._server_late(gap, seen):
                        s.stalls += 1
                    else:
                        s.client_stalls += 1
                elif seen - self.last_text_seen > self.stall_s:
                    s.client_stalls += 1     # the bytes came in time; we saw them late
            self.last_text_at = now
            self.last_text_seen = seen
        if d.error is not None:
            # The server gave up mid-stream in its own words (e.g. Anthropic overloaded_error).
            raise _Failed("http_status", f"error event in the stream: {d.error}")
        if d.done:
            if self.finish_required and s.finish_reason is None:
                # llama-cpp-python's server ends a running answer this way when another
                # request waits: the tokens so far are not the answer asked for.
                raise _Failed("truncated", "the stream's final event came without a finish "
                                           "reason: the server ended the answer early")
            self.done = True

    def _count_read(self, now: float, seen: float, with_headers: bool) -> None:
        """Count the reads that brought content, and the content events that came in bursts
        (BURST_WAIT_MS). The first read's wait is mostly the server's prompt processing: its
        events count as a burst when the response headers were held back with them, or once
        a later read is a burst (the stream is being held)."""
        s = self.sample
        if now != self.last_text_at:
            s.content_reads += 1
            self.read_events = 1
            if self.last_text_at is None:
                self.read_held = with_headers and self._held(now - self.t0, seen)
            else:
                self.read_held = self._held(now - self.last_text_at, seen)
        else:
            self.read_events += 1
        if s.content_reads == 1:
            if self.read_held:
                s.burst_reads += self.read_events == 1
                s.burst_events += 1
            else:
                self.first_read_events = self.read_events
        elif self.read_held and self.read_events > 1:
            new = self.read_events == 2
            s.burst_reads += new
            s.burst_events += (2 if new else 1) + self.first_read_events
            self.first_read_events = 0

    def _held(self, wait: float, seen: float) -> bool:
        """The read came ``wait`` after the one before (or the request) for reasons not ours:
        long enough, and neither our hub's lateness nor a slow consumer's pause."""
        if self.paced or wait * 1000.0 < BURST_WAIT_MS:
            return False
        blocked = 0.0 if self.guard is None else \
            self.guard.blocked_within(self.last_text_seen, seen)
        return (wait - blocked) * 1000.0 >= BURST_WAIT_MS

    def _server_late(self, gap: float, seen: float) -> bool:
        if self.paced:
            return False
        if self.guard is None:
            return True
        return gap - self.guard.blocked_within(self.last_text_seen, seen) > self.stall_s

    def finish(self, end: float) -> RequestSample:
        s = self.sample
        s.e2e_ms = (end - self.t0) * 1000.0
        s.output_tokens = s.usage_tokens if s.usage_tokens is not None else s.content_events
        if self.ids:
            s.expected_events = max(self.ids)
            s.missing_events = s.expected_events - len(self.ids)
        return s


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
        http = HTTPClient.from_url(
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
        self, cls: RequestClassPlan, rng: random.Random, scheduled: float | None = None
    ) -> RequestSample:
        """Send one request of class ``cls`` now and follow its stream to the end.

        Always returns a sample: within the plan's timeout (checked between reads, so a socket
        that never runs dry cannot hold it), and with any credential redacted from its reason.
        """
        path, body = build_request(self.plan.protocol, self.plan.model, cls, rng)
        uri = join_path(self._prefix, self._path or path)
        payload = json.dumps(body).encode()
        trace_id, traceparent = _traceparent()     # fresh per attempt
        headers = {**self._headers, "traceparent": traceparent}
        sample = RequestSample(cls=cls.name, sent=time.time(), scheduled=scheduled,
                               trace_id=trace_id)
        t0 = time.perf_counter()
        setattr(gevent.getcurrent(), _WRITTEN, None)
        setattr(gevent.getcurrent(), _CONN, None)
        deadline_at = t0 + self.plan.timeout_s
        tally = _Tally(sample, self.plan, t0, self.max_events, self_measure.active())
        resp: HTTPSocketResponse | None = None
        deadline = gevent.Timeout(self.plan.timeout_s, _StreamTimeout())
        deadline.start()
        try:
            try:
                resp = self._open(self._pool_for(cls.read), uri, payload, headers, tally,
                                  deadline_at)
                slow = None if cls.read is None else _SlowReader(cls.read, tally)
                end = self._follow(resp, tally, deadline_at, slow)
            except _Failed as exc:
                end = time.perf_counter()
                sample.error, sample.error_detail = exc.kind, exc.detail
            except _StreamTimeout:
                end = time.perf_counter()
                sample.error = "timeout"
                sample.error_detail = (
                    f"no complete stream within {self.plan.timeout_s:g} s"
                    + ("" if sample.ttfb_ms is not None else " (no response headers)")
                )
            finally:
                deadline.cancel()
                tally.dated(t0)     # a request that failed after its write: timed from it
            if resp is not None and tally.done:
                _drain(resp)
        finally:
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
        return tally.finish(end)

    def _open(
        self, http: HTTPClient, uri: str, payload: bytes, headers: dict[str, str],
        tally: _Tally, deadline: float
    ) -> HTTPSocketResponse:
        sample, t0 = tally.sample, tally.t0
        try:
            resp = http.request("POST", uri, body=payload, headers=headers)
        except (OSError, HTTPParseError) as exc:
            raise _Failed(*_before_response(exc, self.plan.connect_timeout_s)) from exc
        headers_at = time.perf_counter()
        tally.dated(t0)
        sample.ttfb_ms = (headers_at - tally.t0) * 1000.0
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
                slow: _SlowReader | None = None) -> float:
        """Feed the stream to ``tally`` until its terminal event; return when it arrived. A
        ``slow`` consumer reads small blocks at its own pace, and times each event when it
        read it, not when the kernel had it (that is what this consumer saw)."""
        parser = SSEParser(self.limits)
        arrival = Arrival(resp._sock if slow is None else None, time.perf_counter())
        size = _BLOCK if slow is None else slow.size
        guard = tally.guard
        kernel_reads = user_reads = 0
        next_yield = time.perf_counter() + _YIELD_S
        try:
            while True:
                chunk = _read_some(resp, deadline, arrival, size)
                now = arrival.seen
                if not chunk:
                    raise _Failed("truncated", "the stream ended before the protocol's final event")
                tally.sample.body_bytes += len(chunk)
                events = parser.feed(chunk)
                if events and not arrival.with_headers:
                    # The stream's clock: "kernel" while every read off the socket that
                    # brought events had a stamp (bytes that came with the headers are timed
                    # at the headers, as TTFB is).
                    if arrival.kernel:
                        kernel_reads += 1
                        if guard is not None:
                            guard.seen(arrival.seen - arrival.at, len(events))
                    else:
                        user_reads += 1
                        if guard is not None:
                            guard.user_read()
                    tally.sample.clock = "kernel" if kernel_reads and not user_reads else "user"
                for event in events:
                    tally.add(event, arrival.at, now, arrival.kernel, arrival.with_headers)
                    if tally.done:
                        return arrival.at
                if slow is not None:
                    slow.pace(len(chunk), len(events))
                # A socket that always has data never blocks, so the gevent timeout never
                # fires: the deadline is checked here too.
                if now > deadline:
                    raise _StreamTimeout()
                if len(chunk) >= _BACKLOG and now >= next_yield:
                    # ... and no other user (nor Locust's own timers) would run: a backlog
                    # of a full read yields, every _YIELD_S, until the loop has polled I/O.
                    gevent.idle()
                    next_yield = time.perf_counter() + _YIELD_S
        except SSELimitError as exc:
            raise _Failed("limit", str(exc)) from exc
        except (HTTPConnectionClosed, OSError) as exc:
            raise _Failed("truncated", f"the stream broke off: {_oserror_text(exc)}") from exc
        except HTTPParseError as exc:
            raise _Failed("protocol",
                          f"invalid HTTP framing of the body: {_parse_error_text(exc)}") from exc


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


def _drain(resp: HTTPSocketResponse) -> None:
    """Read to the end of the HTTP body, briefly and boundedly, so that its connection can be
    reused; a body that does not end soon is left unread, and the connection dropped."""
    until = time.perf_counter() + _DRAIN_S
    left = _DRAIN_MAX
    with gevent.Timeout(_DRAIN_S, False):
        try:
            while left > 0:
                chunk = _read_some(resp, until)
                if not chunk:
                    return
                left -= len(chunk)
                if time.perf_counter() > until:
                    return
        except (_StreamTimeout, OSError, HTTPParseError):
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
