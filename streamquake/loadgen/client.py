"""Measure one streaming request, timestamping every SSE event as its bytes come off the socket.

Runs under gevent (inside the Locust process, or any greenlet). geventhttpclient parses the
HTTP response, but its ``read()`` blocks for a whole block and Locust's ``iter_lines()`` hands
lines over late, so :func:`_read_some` takes whatever body bytes each ``recv`` brought.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import gevent
import gevent.ssl
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError, HTTPSocketResponse
from geventhttpclient.url import URL

from streamquake.errors import ScenarioError
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import ErrorKind, RequestSample
from streamquake.loadgen.sse import SSEEvent, SSEParser
from streamquake.loadgen.wire import ProtocolError, build_request, decode, protocol_headers

_BLOCK = 64 * 1024
_ERROR_BODY_MAX = 4096
_DRAIN_S = 1.0          # after the terminal event, how long to wait for the HTTP body's end
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _StreamTimeout(Exception):
    """The whole-stream deadline (plan.timeout_s) passed."""


class _Failed(Exception):
    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.kind: ErrorKind = kind
        self.detail = detail


def expand_headers(headers: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Replace ``${VAR}`` in header values from ``environ``; name the variable if it is unset."""
    missing: list[str] = []

    def sub(name: str) -> Callable[[re.Match[str]], str]:
        def repl(m: re.Match[str]) -> str:
            var = m.group(1)
            if var not in environ:
                missing.append(f"header {name!r} uses ${{{var}}}, but {var} is not set in the "
                               "environment of the load process: export it before the run")
                return ""
            return environ[var]
        return repl

    out = {name: _ENV_REF.sub(sub(name), value) for name, value in headers.items()}
    if missing:
        raise ScenarioError(missing)
    return out


def _tls_context_factory(verify: bool) -> Callable[..., ssl.SSLContext]:
    def factory(cafile: str | None = None, **_: Any) -> ssl.SSLContext:
        # The system store honours SSL_CERT_FILE / SSL_CERT_DIR at call time, which is how a
        # private CA gets trusted; geventhttpclient's own bundle is added on top.
        ctx: ssl.SSLContext = gevent.ssl.create_default_context()
        if cafile and os.path.isfile(cafile):
            ctx.load_verify_locations(cafile=cafile)
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return factory


def _read_some(resp: HTTPSocketResponse) -> bytes:
    """Body bytes available now, after at most one ``recv``; b"" once the body has ended.

    Uses the response's parser buffer and socket directly: the public ``read(n)`` waits for
    ``n`` bytes, which would hold early events back until later ones arrive.
    """
    buf = resp._body_buffer
    while not buf:
        if resp.message_complete:
            return b""
        sock = resp._sock
        if sock is None:
            raise HTTPConnectionClosed("connection closed")
        data = sock.recv(_BLOCK)
        resp.feed(data)   # b"" tells the parser the peer closed; a cut chunked body raises
        if not data:
            if not resp.message_complete:
                raise HTTPConnectionClosed("connection closed")
            break
    out = bytes(buf)
    del buf[:]
    return out


class _Tally:
    """Folds a stream's events into a RequestSample as they arrive."""

    def __init__(self, sample: RequestSample, plan: LoadPlan, t0: float) -> None:
        self.sample = sample
        self.protocol = plan.protocol
        self.stall_s = plan.stall_threshold_ms / 1000.0
        self.t0 = t0
        self.last_text_at: float | None = None
        self.ids: set[int] = set()
        self.done = False

    def add(self, event: SSEEvent, now: float) -> None:
        s = self.sample
        if event.id is not None and event.id.isdigit():
            self.ids.add(int(event.id))
        try:
            d = decode(self.protocol, event)
        except ProtocolError as exc:
            raise _Failed("protocol", str(exc)) from exc
        if d.usage_output_tokens is not None:
            s.usage_tokens = d.usage_output_tokens
        if d.text:
            s.content_events += 1
            if self.last_text_at is None:
                s.ttft_ms = (now - self.t0) * 1000.0
            else:
                gap = now - self.last_text_at
                s.itl_ms.append(gap * 1000.0)
                if gap > self.stall_s:
                    s.stalls += 1
            self.last_text_at = now
        if d.error is not None:
            # The server gave up mid-stream in its own words (e.g. Anthropic overloaded_error).
            raise _Failed("http_status", f"error event in the stream: {d.error}")
        if d.done:
            self.done = True

    def finish(self, end: float) -> RequestSample:
        s = self.sample
        s.e2e_ms = (end - self.t0) * 1000.0
        s.output_tokens = s.usage_tokens if s.usage_tokens is not None else s.content_events
        if self.ids:
            s.expected_events = max(self.ids)
            s.missing_events = s.expected_events - len(self.ids)
        return s


class StreamClient:
    """Streams requests of one load plan over a connection pool of ``concurrency`` sockets."""

    def __init__(
        self,
        plan: LoadPlan,
        *,
        concurrency: int = 1,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.plan = plan
        url = URL(plan.base_url)
        self._prefix = url.path.rstrip("/")
        self._headers = {
            **protocol_headers(plan.protocol),
            **expand_headers(plan.headers, os.environ if environ is None else environ),
        }
        self._http = HTTPClient.from_url(
            url,
            concurrency=concurrency,
            connection_timeout=plan.connect_timeout_s,
            # Longer than the whole-stream deadline, so a socket timeout can only mean connect.
            network_timeout=plan.timeout_s + 1.0,
            ssl_context_factory=_tls_context_factory(plan.verify_tls),
            insecure=not plan.verify_tls,
            block_size=_BLOCK,
        )

    def close(self) -> None:
        self._http.close()

    def measure(
        self, cls: RequestClassPlan, rng: random.Random, scheduled: float | None = None
    ) -> RequestSample:
        """Send one request of class ``cls`` now and follow its stream to the end."""
        path, body = build_request(self.plan.protocol, self.plan.model, cls, rng)
        uri = self._prefix + (self.plan.path or path)
        payload = json.dumps(body).encode()
        sample = RequestSample(cls=cls.name, sent=time.time(), scheduled=scheduled)
        t0 = time.perf_counter()
        tally = _Tally(sample, self.plan, t0)
        resp: HTTPSocketResponse | None = None
        deadline = gevent.Timeout(self.plan.timeout_s, _StreamTimeout())
        deadline.start()
        try:
            try:
                resp = self._open(uri, payload, sample, t0)
                end = self._follow(resp, tally)
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
            if resp is not None and tally.done:
                _drain(resp)
        finally:
            # Also on GreenletExit (Locust stopping a user): never leak the socket.
            if resp is not None:
                resp.release()
        return tally.finish(end)

    def _open(
        self, uri: str, payload: bytes, sample: RequestSample, t0: float
    ) -> HTTPSocketResponse:
        try:
            resp = self._http.request("POST", uri, body=payload, headers=self._headers)
        except (OSError, HTTPParseError) as exc:
            raise _Failed(*_before_response(exc, self.plan.connect_timeout_s)) from exc
        sample.ttfb_ms = (time.perf_counter() - t0) * 1000.0
        sample.status = resp.status_code
        if not 200 <= resp.status_code < 300:
            detail = _error_message(resp)
            resp.release()
            raise _Failed("http_status", f"HTTP {resp.status_code}{detail}")
        ctype = resp.get("content-type")
        if not isinstance(ctype, str) or "text/event-stream" not in ctype.lower():
            resp.release()
            raise _Failed("protocol", "the response is not an event stream "
                                      "(Content-Type is not text/event-stream)")
        return resp

    def _follow(self, resp: HTTPSocketResponse, tally: _Tally) -> float:
        """Feed the stream to ``tally`` until its terminal event; return that event's time."""
        parser = SSEParser()
        try:
            while True:
                chunk = _read_some(resp)
                now = time.perf_counter()
                if not chunk:
                    raise _Failed("truncated", "the stream ended before the protocol's final event")
                for event in parser.feed(chunk):
                    tally.add(event, now)
                    if tally.done:
                        return now
        except (OSError, HTTPParseError) as exc:
            raise _Failed("truncated", f"the stream broke off: {_oserror_text(exc)}") from exc


def _drain(resp: HTTPSocketResponse) -> None:
    """Read to the end of the HTTP body, briefly, so that its connection can be reused."""
    with gevent.Timeout(_DRAIN_S, False):
        try:
            while _read_some(resp):
                pass
        except (OSError, HTTPParseError):
            pass


def _before_response(exc: BaseException, connect_timeout_s: float) -> tuple[ErrorKind, str]:
    if isinstance(exc, ssl.SSLError):
        return "connect", f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "connect", f"no connection within {connect_timeout_s:g} s"
    if isinstance(exc, socket.gaierror):
        return "connect", f"cannot resolve the host: {exc.strerror}"
    if isinstance(exc, HTTPConnectionClosed | ConnectionResetError | BrokenPipeError):
        return "connect", "the server closed the connection before answering"
    if isinstance(exc, HTTPParseError):
        return "protocol", f"invalid HTTP response: {exc}"
    return "connect", _oserror_text(exc)


def _oserror_text(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _error_message(resp: HTTPSocketResponse) -> str:
    """``": message"`` from an API error body, or "" when there is none to read."""
    try:
        raw = b""
        while len(raw) < _ERROR_BODY_MAX:
            chunk = _read_some(resp)
            if not chunk:
                break
            raw += chunk
        obj = json.loads(raw[:_ERROR_BODY_MAX])
    except (OSError, HTTPParseError, ValueError):
        return ""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    message = err.get("message") if isinstance(err, dict) else None
    return f": {str(message)[:200]}" if message else ""
