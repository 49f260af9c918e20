"""One noisy tenant's stream: a streaming request built by the wire format's own request
builder (``streamquake.protocols``), sent with blocking ``http.client``, its SSE answer read to
the end and counted. Every wait (connect, the answer's head, each read) has the tenant's
timeout; ``Opened.close`` from another thread ends a stream at once (its socket shut down), as
revert does.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

from streamquake.jsontypes import JsonDict
from streamquake.protocols import ProtocolError, WireProtocol

_LINE_MAX = 1 << 20          # an SSE line longer than this is no answer of any format
NO_ANSWER = (OSError, http.client.HTTPException)      # what a request that got none raises


class Event(NamedTuple):
    event: str
    data: str


@dataclass(frozen=True)
class Request:
    """What every stream of one tenant sends: where, in which format, with which body."""

    url: str                         # the full URL, path and query included
    fmt: WireProtocol
    body: bytes
    headers: dict[str, str]
    verify_tls: bool
    timeout_s: float
    # The URL as the scenario wrote it (``${VAR}`` unexpanded): what messages, the journal and
    # the report show, never a secret a path's query carries (Gemini's ``?key=``).
    shown: str = ""

    @property
    def where(self) -> str:
        return urlsplit(self.url).netloc


@dataclass
class Tally:
    """What the tenant did, shared by its streams' threads."""

    sent: int = 0                    # requests written to the target
    completed: int = 0               # streams the target ended (its terminal event, or EOF)
    closed_at_revert: int = 0        # streams revert closed while the target still sent them
    tokens: int = 0                  # the server's usage count, else content events
    bytes: int = 0                   # body bytes received
    skipped: int = 0                 # arrivals missed because every stream was busy (rate)
    failures: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> JsonDict:
        with self.lock:
            return {"requests_sent": self.sent, "streams_completed": self.completed,
                    "streams_closed_at_revert": self.closed_at_revert,
                    "errors": sum(self.failures.values()), "failures": dict(self.failures),
                    "tokens_received": self.tokens, "bytes_received": self.bytes,
                    "arrivals_skipped": self.skipped}


class Opened:
    """The connections open now, so that revert can close them from its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: set[http.client.HTTPConnection] = set()
        self.closing = False

    def add(self, conn: http.client.HTTPConnection) -> bool:
        with self._lock:
            if self.closing:
                return False
            self._conns.add(conn)
            return True

    def discard(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> int:
        """Shut every open stream's socket down (its reader wakes at once); how many."""
        with self._lock:
            self.closing = True
            conns = list(self._conns)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):     # already closed: nothing to end
                    sock.shutdown(socket.SHUT_RDWR)
        return len(conns)


def connection(req: Request) -> http.client.HTTPConnection:
    parts = urlsplit(req.url)
    host = parts.hostname or "127.0.0.1"
    if parts.scheme == "https":
        context = ssl.create_default_context()
        if not req.verify_tls:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(host, parts.port, timeout=req.timeout_s,
                                           context=context)
    return http.client.HTTPConnection(host, parts.port, timeout=req.timeout_s)


def target_of(url: str) -> str:
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "") or "/"


def reason_of(exc: BaseException, timeout_s: float) -> str:
    """A short reason, for a failure count."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, http.client.HTTPException):
        return f"bad HTTP answer ({type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


class Answer(NamedTuple):
    status: int
    message: str


def answer_message(resp: http.client.HTTPResponse) -> str:
    """The server's words for a refusal: its JSON error's message, else the body's start."""
    text = resp.read(1 << 14).decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    said = error.get("message") if isinstance(error, dict) else error
    return " ".join((said if isinstance(said, str) else text).split())[:200] or "(empty body)"


def ask_once(req: Request) -> Answer:
    """One request whose answer's head is read and the stream left: for preflight. Raises
    OSError or http.client.HTTPException when no answer comes."""
    conn = connection(req)
    try:
        conn.request("POST", target_of(req.url), body=req.body, headers=req.headers)
        resp = conn.getresponse()
        return Answer(resp.status, "" if resp.status == 200 else answer_message(resp))
    finally:
        conn.close()


def stream_once(req: Request, tally: Tally, opened: Opened) -> bool:
    """Send one request and read its stream to the end, counting into ``tally``. False when it
    failed (the caller backs off), True otherwise (ended, or closed by revert)."""
    conn = connection(req)
    if not opened.add(conn):
        return True
    tokens, sent = 0, False
    try:
        conn.connect()
        if opened.closing:           # revert came while connecting: its close missed this one
            return True
        conn.request("POST", target_of(req.url), body=req.body, headers=req.headers)
        with tally.lock:
            tally.sent += 1
        sent = True
        resp = conn.getresponse()
        if resp.status != 200:
            reason = f"HTTP {resp.status}: {answer_message(resp)}"
            with tally.lock:
                tally.failures[reason] += 1
            return False
        ended, tokens, error = _read_stream(resp, req.fmt, tally)
        with tally.lock:
            tally.tokens += tokens
            if error is not None:
                tally.failures[f"error event: {error[:120]}"] += 1
            elif ended or not opened.closing:
                tally.completed += 1
            else:
                tally.closed_at_revert += 1
        return error is None
    except (OSError, http.client.HTTPException) as exc:
        with tally.lock:
            if opened.closing:
                tally.closed_at_revert += sent      # one never sent was no stream to close
            else:
                tally.failures[reason_of(exc, req.timeout_s)] += 1
        return opened.closing
    finally:
        opened.discard(conn)
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, fmt: WireProtocol, tally: Tally
                 ) -> tuple[bool, int, str | None]:
    """Read SSE events to the end: (the format's terminal event came, tokens, error)."""
    content = 0
    usage: int | None = None
    name, data = "", []
    while True:
        line = resp.readline(_LINE_MAX)
        if not line:
            return False, usage if usage is not None else content, None
        with tally.lock:
            tally.bytes += len(line)
        text = line.decode(errors="replace").rstrip("\r\n")
        if text:
            key, _, value = text.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
            continue
        if not data:
            name = ""
            continue
        try:
            decoded = fmt.decode(Event(name or "message", "\n".join(data)))
        except ProtocolError as exc:
            return False, content, f"not {fmt.name}: {exc}"
        name, data = "", []
        content += decoded.generated
        if decoded.usage_output_tokens is not None:
            usage = decoded.usage_output_tokens
        if decoded.error is not None:
            return False, usage if usage is not None else content, decoded.error
        if decoded.done:
            return True, usage if usage is not None else content, None
