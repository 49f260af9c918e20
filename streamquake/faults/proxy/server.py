"""The SSE-aware fault proxy: a reverse proxy that applies faults per SSE event.

Run: ``python -m streamquake.faults.proxy.server --upstream URL --host 127.0.0.1 --port 0``;
it prints ``LISTENING http://host:port`` once bound. Everything under ``/_streamquake/`` is the
control API (``PUT``/``DELETE /_streamquake/faults/{name}``, ``GET /_streamquake/faults``,
``GET /_streamquake/stats``); everything else is forwarded to the upstream.

``text/event-stream`` responses are cut into events and each event is written as soon as it is
complete, after the active faults have had their say (see ``injector.py`` for what each fault
does; ``framing.py`` cuts the events, ``decisions.py`` decides); while no fault is active, each
read's complete events go out as they came, counted but unparsed. Other responses are copied
chunk by chunk, untouched. Header values are never logged, nor query
strings (Gemini puts its API key there).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from pydantic import ValidationError
from yarl import URL

from streamquake.errors import validation_sentences
from streamquake.faults.proxy.decisions import (
    CONTINUE,
    END,
    ERROR,
    HANG,
    RESET,
    ActiveFault,
    Stats,
    StreamFaults,
)
from streamquake.faults.proxy.framing import SSEFramer, count_events, parse_event
from streamquake.faults.proxy.spec import fault_from_params
from streamquake.faults.proxy.wire import CONTROL_PREFIX, KEY_HEADER, PROXY_KEY_ENV
from streamquake.procs import child_env, python_module_cmd, read_listening_line, spawn, stop
from streamquake.units import parse_duration_s

log = logging.getLogger("streamquake.proxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade",
})
# Encodings aiohttp decodes without optional packages; the proxy must see plain SSE text.
_DECODABLE = frozenset({"gzip", "deflate", "identity"})


@dataclass
class ProxyState:
    upstream: URL
    seed: int
    connect_timeout_s: float
    read_timeout_s: float
    insecure: bool = False
    # A run's private proxy: faults change only with this key (KEY_HEADER); None: any caller.
    control_key: str | None = None
    faults: dict[str, ActiveFault] = field(default_factory=dict)
    totals: Stats = field(default_factory=Stats)
    session: aiohttp.ClientSession | None = None
    # No pool: a retry must not meet another connection the upstream is closing.
    fresh_session: aiohttp.ClientSession | None = None
    _last_error_log: float = 0.0

    def log_upstream_error(self, message: str) -> None:
        # Under load a dead upstream fails every request; one line a second is enough.
        now = time.monotonic()
        if now - self._last_error_log >= 1.0:
            self._last_error_log = now
            log.warning("%s (upstream errors so far: %d)", message, self.totals.upstream_errors)


PROXY = web.AppKey("proxy", ProxyState)


# --- one proxied SSE stream ---------------------------------------------------------------------

# The upstream failed mid-stream: the client must not see a clean end.
_BROKEN = "broken"
_EOF = object()


async def _pump(content: aiohttp.StreamReader, framer: SSEFramer, queue: asyncio.Queue[Any]
                ) -> None:
    """Read the upstream as fast as it sends; queue each read's blocks with their arrival time."""
    loop = asyncio.get_running_loop()
    try:
        async for chunk in content.iter_any():
            data, ends = framer.feed_joined(chunk)
            if ends:
                await queue.put((loop.time(), data, ends, False))
        rest = framer.flush()
        if rest:
            await queue.put((loop.time(), rest, [len(rest)], True))
        await queue.put(_EOF)
    except (TimeoutError, aiohttp.ClientError) as exc:
        await queue.put(exc)


def _reset_connection(request: web.Request) -> None:
    """RST, not FIN: SO_LINGER with a zero timeout makes close() abort the connection."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _SSERelay:
    """Moves one stream's events from the upstream to the client, faults applied.

    Each event goes out as soon as it is due. Events that are due together (they came in one
    upstream read, or the client fell behind) leave in one write: nothing waits for that. While
    no fault is active and nothing is held back, a read's events leave as they came, unparsed.
    The relay reads the upstream itself until an event has to wait (a delay, a stall) or the
    client falls behind; from then on a pump task reads, so that arrivals are stamped as they
    come, and the relay takes them from its queue.
    """

    def __init__(self, resp: web.StreamResponse, upstream: aiohttp.ClientResponse,
                 stream: StreamFaults, proxy: ProxyState,
                 transport: asyncio.BaseTransport | None, path: str = "") -> None:
        self.resp = resp
        self.path = path
        self.upstream = upstream
        self.stream = stream
        self.proxy = proxy
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.framer = SSEFramer()
        self.pending: list[bytes] = []
        self.queue: asyncio.Queue[Any] | None = None
        self.pump: asyncio.Task[None] | None = None

    async def run(self) -> str:
        try:
            outcome = self.stream.limits_reached(self.stream.faults())
            if outcome == CONTINUE:
                outcome = await self._read()
            if outcome == CONTINUE:
                outcome = await self._from_pump()
            if self.stream.held is not None and outcome in (END, ERROR):
                # A tool-call chunk ``reorder`` held for a second that never came.
                raw = self.stream.take_held()
                self.pending.append(raw)
                self.stream.count_forwarded(self.stream.faults(), len(raw), False)
            if outcome == ERROR:
                raw = self.stream.error_bytes(self.path)
                self.pending.append(raw)
                self.stream.count_forwarded(self.stream.faults(), len(raw), True)
                outcome = END   # the server's own end after its error: a clean one
            await self._flush()
            if outcome == HANG:
                outcome = await self._hang()
            return outcome
        finally:
            if self.pump is not None:
                self.pump.cancel()
                await asyncio.gather(self.pump, return_exceptions=True)

    async def _hang(self) -> str:
        """Send nothing more and hold the connection open, as a hung server does, until the
        client closes it or the proxy's read timeout passes (a bound, so that no stream is held
        for ever); then break it off, never a clean end."""
        if self.pump is not None:
            self.pump.cancel()
            await asyncio.gather(self.pump, return_exceptions=True)
            self.pump = None
        self.upstream.close()       # the rest of the answer is not wanted
        transport = self.transport
        until = self.loop.time() + self.proxy.read_timeout_s
        while transport is not None and not transport.is_closing():
            if self.loop.time() >= until:
                return _BROKEN
            await asyncio.sleep(0.05)
        self.stream.hang_ended_by_client()
        return _BROKEN

    def _hand_over(self) -> None:
        """A pump task reads the upstream from now on."""
        if self.queue is None:
            self.queue = asyncio.Queue(maxsize=1024)
            self.pump = asyncio.create_task(_pump(self.upstream.content, self.framer, self.queue))

    async def _read(self) -> str:
        """Read and relay in this task; CONTINUE once a pump reads instead."""
        content = self.upstream.content
        while self.queue is None:
            try:
                chunk = await content.readany()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._broken(exc)
            if not chunk:
                rest = self.framer.flush()
                outcome = (await self._blocks(self.loop.time(), rest, [len(rest)], True) if rest
                           else CONTINUE)
                return END if outcome == CONTINUE else outcome
            data, ends = self.framer.feed_joined(chunk)
            outcome = await self._blocks(self.loop.time(), data, ends)
            if outcome != CONTINUE:
                return outcome
            await self._flush()
        return CONTINUE

    async def _from_pump(self) -> str:
        queue = self.queue
        assert queue is not None
        while True:
            if queue.empty():
                await self._flush()
            item = await queue.get()
            if item is _EOF:
                return END
            if isinstance(item, BaseException):
                return self._broken(item)
            outcome = await self._blocks(*item)
            if outcome != CONTINUE:
                return outcome

    def _broken(self, exc: BaseException) -> str:
        self.proxy.totals.upstream_errors += 1
        self.proxy.log_upstream_error(f"upstream failed mid-stream: {exc!r}")
        return _BROKEN

    async def _flush(self) -> None:
        if self.pending:
            data = b"".join(self.pending)
            self.pending.clear()
            await self.resp.write(data)
            transport = self.transport
            if self.queue is None and transport is not None and isinstance(
                    transport, asyncio.WriteTransport) and transport.get_write_buffer_size():
                self._hand_over()  # the client falls behind: arrivals are still stamped

    async def _blocks(self, arrived: float, data: bytes, ends: list[int], tail: bool = False
                      ) -> str:
        """Relay one read's blocks (``tail``: the body's unended rest, no event)."""
        stream = self.stream
        if not self.proxy.faults and not stream.lag_s and not tail and not stream.spoiling:
            # Nothing to decide or hold back.
            stream.pass_through(len(data), count_events(data, ends))
            if data:
                self.pending.append(data)
            return CONTINUE
        # The fault table changes only while this task waits: read afresh after each wait.
        faults = stream.faults()
        start = 0
        for end in ends:
            raw = data[start:end]
            start = end
            ev = None if tail else parse_event(raw)
            if ev is not None:
                out = stream.decide(ev, raw, faults)
                if out is None:
                    continue
                raw = out
            wait = arrived + stream.lag_s - self.loop.time()
            if wait > 0:
                self._hand_over()
                await self._flush()
                await asyncio.sleep(wait)
            budget = stream.byte_budget(faults)
            if budget is not None and budget < len(raw):
                raw = raw[:budget]
            if raw:
                self.pending.append(raw)
            stream.count_forwarded(faults, len(raw), ev is not None)
            outcome = stream.limits_reached(faults)
            if outcome != CONTINUE:
                return outcome
            if wait > 0:
                faults = stream.faults()
        return CONTINUE


# --- HTTP plumbing ------------------------------------------------------------------------------


def _connection_listed(headers: Any) -> set[str]:
    listed: set[str] = set()
    for value in headers.getall("Connection", []):
        listed.update(v.strip().lower() for v in value.split(","))
    return listed


def _request_headers(request: web.Request) -> CIMultiDict[str]:
    drop = HOP_BY_HOP | _connection_listed(request.headers) | {"host", "content-length"}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in request.headers.items():
        lk = key.lower()
        if lk in drop:
            continue
        if lk == "accept-encoding":
            codings = [c for c in value.split(",") if c.split(";")[0].strip().lower() in _DECODABLE]
            if not codings:
                continue
            value = ",".join(codings).strip()
        out.add(key, value)
    return out


def _response_headers(upstream: aiohttp.ClientResponse, sse: bool) -> CIMultiDict[str]:
    drop = HOP_BY_HOP | _connection_listed(upstream.headers)
    encoding = upstream.headers.get("Content-Encoding", "identity").strip().lower()
    if sse or encoding != "identity":
        # SSE bytes may change and decoded bodies have a new length: both go out chunked.
        drop = drop | {"content-length"}
    if encoding != "identity":
        drop = drop | {"content-encoding"}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in upstream.headers.items():
        if key.lower() not in drop:
            out.add(key, value)
    return out


def _error(status: int, message: str, **headers: str) -> web.Response:
    body = {"error": {"code": status, "message": message, "source": "streamquake-proxy"}}
    return web.json_response(body, status=status, headers=headers)


def _made_error(proxy: ProxyState, status: int, message: str, kind: str) -> web.Response:
    """An error the proxy answers for an upstream that gave it none to pass on."""
    proxy.totals.proxy_errors += 1
    return _error(status, message, **{"X-Streamquake-Proxy": kind})


@dataclass
class _Attempt:
    """Whether a request went out on a pooled connection (the session's trace hooks say)."""

    reused: bool = False


async def _on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
    if isinstance(ctx.trace_request_ctx, _Attempt):
        ctx.trace_request_ctx.reused = True


async def _on_connect(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
                      ) -> None:
    if isinstance(ctx.trace_request_ctx, _Attempt):
        ctx.trace_request_ctx.reused = False


async def _send(proxy: ProxyState, request: web.Request, url: URL, body: bytes
                ) -> aiohttp.ClientResponse:
    """Send upstream; once more, on a fresh connection, if a pooled one turns out closed.

    An upstream may close an idle connection as the pool hands it out (llama-server closes each
    stream's connection while saying Keep-Alive): the request then meets EOF, or a reset, before
    the response headers, and the upstream never took it up (RFC 9112 9.3.1; browsers retry
    such requests alike). A fresh connection's failure, a timeout, and an EOF after part of a
    response are the upstream's own doing, and are not retried.
    """
    assert proxy.session is not None and proxy.fresh_session is not None

    async def send(session: aiohttp.ClientSession, attempt: _Attempt | None
                   ) -> aiohttp.ClientResponse:
        return await session.request(
            request.method, url, headers=_request_headers(request), data=body or None,
            allow_redirects=False, trace_request_ctx=attempt,
        )

    attempt = _Attempt()
    try:
        return await send(proxy.session, attempt)
    except aiohttp.ServerDisconnectedError as exc:
        # Its ``message`` is the response as far as it came, if any byte of one did.
        if not attempt.reused or not isinstance(exc.message, str):
            raise
    except (aiohttp.ClientOSError, aiohttp.ClientConnectionResetError):
        if not attempt.reused:
            raise
    proxy.totals.upstream_retries += 1
    return await send(proxy.fresh_session, None)


async def _open_upstream(request: web.Request, proxy: ProxyState
                         ) -> aiohttp.ClientResponse | web.Response:
    body = await request.read()
    url = URL(str(proxy.upstream).rstrip("/") + request.raw_path, encoded=True)
    where = f"{request.method} {request.path}"
    try:
        return await _send(proxy, request, url, body)
    except TimeoutError as exc:
        proxy.totals.upstream_errors += 1
        message = (f"the upstream {proxy.upstream.host}:{proxy.upstream.port} did not answer "
                   f"{where} in time ({type(exc).__name__})")
        proxy.log_upstream_error(message)
        return _made_error(proxy, 504, message, "upstream-timeout")
    except aiohttp.ClientError as exc:
        proxy.totals.upstream_errors += 1
        message = (f"the proxy could not get {where} from the upstream "
                   f"{proxy.upstream.host}:{proxy.upstream.port}: {exc}")
        proxy.log_upstream_error(message)
        return _made_error(proxy, 502, message, "upstream-error")


async def forward(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    proxy.totals.requests += 1
    stream = StreamFaults(proxy.faults, proxy.totals, request.path)
    aborted = stream.abort_status(stream.faults())
    if aborted is not None:
        status, retry_after, name = aborted
        headers = {"X-Streamquake-Fault": name}
        if retry_after is not None:
            headers["Retry-After"] = retry_after
        return _error(status, f"injected by streamquake fault '{name}'", **headers)
    opened = await _open_upstream(request, proxy)
    if isinstance(opened, web.Response):
        return opened
    upstream = opened
    resp: web.StreamResponse | None = None
    try:
        sse = upstream.content_type == "text/event-stream"
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                  headers=_response_headers(upstream, sse))
        await resp.prepare(request)
        if sse:
            outcome = await _SSERelay(resp, upstream, stream, proxy, request.transport,
                                      request.path).run()
        else:
            outcome = await _relay_raw(resp, upstream, proxy)
        if outcome == RESET:
            _reset_connection(request)
        elif outcome == _BROKEN and request.transport is not None:
            # A clean end would tell the client the stream was complete; it was not.
            request.transport.abort()
        else:
            await resp.write_eof()
        return resp
    except ConnectionResetError:
        # The client went away; nothing to tell it.
        return resp if resp is not None else web.Response(status=499)
    except (TimeoutError, aiohttp.ClientError) as exc:
        proxy.totals.upstream_errors += 1
        proxy.log_upstream_error(f"upstream failed during {request.method} {request.path}: {exc!r}")
        if resp is None:
            return _made_error(proxy, 502, f"the upstream failed: {exc!r}", "upstream-error")
        if request.transport is not None:
            request.transport.abort()
        return resp
    finally:
        upstream.close()


async def _relay_raw(resp: web.StreamResponse, upstream: aiohttp.ClientResponse,
                     proxy: ProxyState) -> str:
    async for chunk in upstream.content.iter_any():
        await resp.write(chunk)
        proxy.totals.bytes += len(chunk)
    return END


# --- control API --------------------------------------------------------------------------------


def _foreign(request: web.Request) -> web.Response | None:
    """A 403 for a change to a private proxy's faults without its run's key; None if allowed."""
    key = request.app[PROXY].control_key
    if key is None or hmac.compare_digest(request.headers.get(KEY_HEADER, ""), key):
        return None
    log.warning("refused %s %s: not from the run this proxy belongs to", request.method,
                request.path)
    return web.json_response(
        {"error": "this SSE proxy is a run's own: only that run puts faults into it or takes "
                  "them out, so its verdicts measure its own faults; for a game day start a "
                  "standing proxy (`streamquake proxy --upstream URL`) and inject into that"},
        status=403)


async def put_fault(request: web.Request) -> web.Response:
    if (refused := _foreign(request)) is not None:
        return refused
    proxy = request.app[PROXY]
    name = request.match_info["name"]
    try:
        params = await request.json()
    except ValueError:
        return web.json_response({"error": "the body must be a JSON object of fault parameters"},
                                 status=400)
    if not isinstance(params, dict):
        return web.json_response({"error": "the body must be a JSON object of fault parameters"},
                                 status=400)
    try:
        spec = fault_from_params(params)
    except ValidationError as exc:
        return web.json_response({"error": f"invalid fault '{name}'",
                                  "problems": validation_sentences(exc)}, status=400)
    seed = spec.seed if spec.seed is not None else proxy.seed
    replaced = proxy.faults.pop(name, None) is not None
    proxy.faults[name] = ActiveFault(name, spec, seed)
    log.info("fault '%s' on: %s", name, json.dumps(spec.proxy_params()))
    return web.json_response({"name": name, "fault": spec.proxy_params(), "replaced": replaced})


async def delete_fault(request: web.Request) -> web.Response:
    if (refused := _foreign(request)) is not None:
        return refused
    proxy = request.app[PROXY]
    name = request.match_info["name"]
    af = proxy.faults.pop(name, None)
    if af is None:
        return web.json_response({"name": name, "removed": False, "fault": None, "stats": None})
    log.info("fault '%s' off", name)
    return web.json_response({"name": name, "removed": True, "fault": af.spec.proxy_params(),
                              "stats": af.stats.as_dict()})


async def list_faults(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    return web.json_response(
        {"faults": {n: af.spec.proxy_params() for n, af in proxy.faults.items()}}
    )


async def get_stats(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    return web.json_response({
        "faults": {n: af.stats.as_dict() for n, af in proxy.faults.items()},
        "totals": proxy.totals.as_dict(),
    })


async def unknown_control(request: web.Request) -> web.Response:
    return web.json_response(
        {"error": f"no control endpoint {request.method} {request.path}; see "
                  f"{CONTROL_PREFIX}/faults and {CONTROL_PREFIX}/stats"},
        status=404,
    )


def build_app(state: ProxyState) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[PROXY] = state

    def session(force_close: bool) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, ssl=not state.insecure, force_close=force_close)
        timeout = aiohttp.ClientTimeout(total=None, connect=state.connect_timeout_s,
                                        sock_read=state.read_timeout_s)
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        trace.on_connection_create_start.append(_on_connect)
        return aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=True, trace_configs=[trace],
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
        )

    async def client_session(app: web.Application) -> AsyncIterator[None]:
        async with session(force_close=False) as pooled, session(force_close=True) as fresh:
            state.session, state.fresh_session = pooled, fresh
            yield
            state.session = state.fresh_session = None

    app.cleanup_ctx.append(client_session)
    faults = f"{CONTROL_PREFIX}/faults"
    app.router.add_put(faults + "/{name}", put_fault)
    app.router.add_delete(faults + "/{name}", delete_fault)
    app.router.add_get(faults, list_faults)
    app.router.add_get(f"{CONTROL_PREFIX}/stats", get_stats)
    app.router.add_route("*", CONTROL_PREFIX + "/{tail:.*}", unknown_control)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


# --- process entry point and handle -------------------------------------------------------------


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve(state: ProxyState, host: str, port: int,
                announce: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT (``announce(url)`` once bound). The faults still on then
    are removed first, so that the streams still open end without them."""
    runner = web.AppRunner(build_app(state), access_log=None, handle_signals=False,
                           shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        url = f"http://{_url_host(host)}:{runner.addresses[0][1]}"
        if announce is not None:
            announce(url)
        print(f"LISTENING {url}", flush=True)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        for name in list(state.faults):
            log.info("stopping: fault '%s' removed", name)
        state.faults.clear()
    finally:
        await runner.cleanup()


def run_serving(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run``, on uvloop where it is installed: its sockets, timers and callbacks are C,
    which makes the relay's per-event cost about half (benchmarks/README.md)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m streamquake.faults.proxy.server",
                                description="SSE-aware fault proxy")
    p.add_argument("--upstream", required=True, help="base URL to forward to")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--upstream-insecure", action="store_true",
                   help="do not verify the upstream's TLS certificate")
    p.add_argument("--connect-timeout", default="10s")
    p.add_argument("--read-timeout", default="120s",
                   help="longest silence from the upstream before the request fails")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="streamquake-proxy: %(levelname)s %(message)s")
    upstream = URL(args.upstream)
    if upstream.scheme not in ("http", "https") or not upstream.host:
        sys.exit(f"--upstream must be an http:// or https:// URL with a host, got {args.upstream}")
    state = ProxyState(
        upstream=upstream, seed=args.seed, insecure=args.upstream_insecure,
        connect_timeout_s=parse_duration_s(args.connect_timeout),
        read_timeout_s=parse_duration_s(args.read_timeout),
        control_key=os.environ.pop(PROXY_KEY_ENV, None) or None,
    )
    run_serving(serve(state, args.host, args.port))


@dataclass
class ProxyProcess:
    """A running proxy child process; ``with`` stops it."""

    proc: subprocess.Popen[bytes]
    url: str
    key: str | None = None      # what its control API wants in KEY_HEADER to change faults

    @property
    def control_url(self) -> str:
        return self.url + CONTROL_PREFIX

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL; safe to call twice."""
        code = stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_proxy(upstream_url: str, seed: int = 0, ready_timeout_s: float = 15.0, *,
                host: str = "127.0.0.1", port: int = 0, insecure: bool = False,
                connect_timeout: str = "10s", read_timeout: str = "120s",
                log_path: Path | None = None, private: bool = False) -> ProxyProcess:
    """Start the proxy as a child that dies with us; returns once it is listening.
    ``private``: a run's own, whose faults change only with the returned process's ``key``."""
    args = ["--upstream", upstream_url, "--host", host, "--port", str(port), "--seed", str(seed),
            "--connect-timeout", connect_timeout, "--read-timeout", read_timeout]
    if insecure:
        args.append("--upstream-insecure")
    cmd = python_module_cmd("streamquake.faults.proxy.server", *args)
    key = secrets.token_urlsafe(24) if private else None
    env = child_env()
    env.pop(PROXY_KEY_ENV, None)
    if key:
        env[PROXY_KEY_ENV] = key
    log_file = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    try:
        proc = spawn(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
                     env=env)
    finally:
        if log_file is not None:
            log_file.close()
    try:
        url = read_listening_line(proc, ready_timeout_s, "the SSE proxy")
    except BaseException:
        ProxyProcess(proc, "").stop()
        raise
    return ProxyProcess(proc, url, key)


if __name__ == "__main__":
    main()
