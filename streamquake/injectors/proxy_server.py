"""The SSE-aware fault proxy: a reverse proxy that applies faults per SSE event.

Run: ``python -m streamquake.injectors.proxy_server --upstream URL --host 127.0.0.1 --port 0``;
it prints ``LISTENING http://host:port`` once bound. Everything under ``/_streamquake/`` is the
control API (``PUT``/``DELETE /_streamquake/faults/{name}``, ``GET /_streamquake/faults``,
``GET /_streamquake/stats``); everything else is forwarded to the upstream.

``text/event-stream`` responses are cut into events and each event is written and drained as
soon as it is complete, after the active faults have had their say (see ``sse_proxy.py`` for
what each fault does). Other responses are copied chunk by chunk, untouched. Header values are
never logged, nor query strings (Gemini puts its API key there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from pydantic import ValidationError
from yarl import URL

from streamquake.injectors.sse_proxy import CONTROL_PREFIX, SSEProxyFault, fault_from_params
from streamquake.procs import child_env, python_module_cmd, read_listening_line, spawn, stop
from streamquake.units import parse_duration_s

log = logging.getLogger("streamquake.proxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade",
})
# Encodings aiohttp decodes without optional packages; the proxy must see plain SSE text.
_DECODABLE = frozenset({"gzip", "deflate", "identity"})
_LINE_END = re.compile(rb"\r\n|\r|\n")
_LINE_END_KEPT = re.compile(rb"(\r\n|\r|\n)")
_CORRUPT_MARK = b"#~streamquake-corrupt~#"
_TEXT_KEYS = frozenset({"text", "content", "partial_json", "thinking", "reasoning_content",
                        "refusal"})
_FINISH_KEYS = frozenset({"finish_reason", "finishReason", "stop_reason"})
_CONTROL_EVENTS = frozenset({b"message_start", b"message_stop", b"message_delta",
                             b"content_block_start", b"content_block_stop", b"ping", b"error",
                             b"done"})


# --- SSE framing --------------------------------------------------------------------------------


class SSEFramer:
    """Cuts a byte stream into raw SSE blocks, each ending with its blank line (LF, CR, CRLF)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._line = 0  # where the line being scanned starts in _buf

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf
        buf += chunk
        blocks: list[bytes] = []
        start, pos = 0, self._line
        while (m := _LINE_END.search(buf, pos)) is not None:
            if m.end() == len(buf) and buf[m.start()] == 0x0D:
                break  # a lone CR at the end may be the first half of a CRLF
            if m.start() == pos:
                blocks.append(bytes(buf[start:m.end()]))
                start = m.end()
            pos = m.end()
        del buf[:start]
        self._line = pos - start
        return blocks

    def flush(self) -> bytes:
        """What is left at the end of the body: an event without its blank line, or nothing."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._line = 0
        return rest


@dataclass(frozen=True)
class SSEEvent:
    name: bytes | None
    data: bytes | None


def parse_event(raw: bytes) -> SSEEvent | None:
    """The fields faults care about; ``None`` for a block of comments or blank lines only."""
    name: bytes | None = None
    data: list[bytes] = []
    fields = False
    for line in _LINE_END.split(raw):
        if not line or line[0] == 0x3A:  # blank or ':' comment
            continue
        key, _, value = line.partition(b":")
        value = value[1:] if value[:1] == b" " else value
        fields = True
        if key == b"data":
            data.append(value)
        elif key == b"event":
            name = value
    if not fields:
        return None
    return SSEEvent(name, b"\n".join(data) if data else None)


def _scan_json(obj: Any, depth: int = 0) -> tuple[bool, bool]:
    """(carries non-empty text, carries a finish marker) anywhere in ``obj``."""
    if depth > 8:
        return False, False
    text = finished = False
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in _FINISH_KEYS and value is not None:
                finished = True
            elif key in _TEXT_KEYS and isinstance(value, str) and value:
                text = True
            elif isinstance(value, dict | list):
                t, f = _scan_json(value, depth + 1)
                text, finished = text or t, finished or f
    elif isinstance(obj, list):
        for value in obj:
            t, f = _scan_json(value, depth + 1)
            text, finished = text or t, finished or f
    return text, finished


def is_content_event(ev: SSEEvent) -> bool:
    """True when losing this event loses generated text and nothing else (see sse_proxy.py)."""
    if ev.data is None or ev.name in _CONTROL_EVENTS:
        return False
    payload = ev.data.strip()
    if not payload or payload == b"[DONE]":
        return False
    try:
        obj = json.loads(payload)
    except ValueError:
        return True
    if isinstance(obj, dict) and "error" in obj:
        return False
    text, finished = _scan_json(obj)
    return text and not finished


def corrupt_event(raw: bytes) -> bytes:
    """Cut each data payload in half and append garbage, so no JSON parser accepts it."""
    parts = _LINE_END_KEPT.split(raw)
    for i in range(0, len(parts), 2):
        line = parts[i]
        if line.startswith(b"data:"):
            payload = line[5:]
            parts[i] = b"data:" + payload[: len(payload) // 2] + _CORRUPT_MARK
    return b"".join(parts)


# --- fault state --------------------------------------------------------------------------------


@dataclass
class Stats:
    """What the proxy did; per fault, and in total (each action counted once there).

    Per fault, ``requests``/``events_seen``/``content_events``/``events_forwarded``/``bytes``
    count what passed while the fault was active, so ``events_dropped / content_events`` is the
    drop rate injected and ``first_event_delays`` the streams whose first event it held back.
    """

    requests: int = 0
    events_seen: int = 0
    content_events: int = 0
    events_forwarded: int = 0
    events_dropped: int = 0
    events_delayed: int = 0
    delay_ms_total: float = 0.0
    first_event_delays: int = 0
    stalls: int = 0
    truncations: int = 0
    aborts_by_status: dict[str, int] = field(default_factory=dict)
    resets: int = 0
    corruptions: int = 0
    upstream_errors: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["delay_ms_total"] = round(self.delay_ms_total, 3)
        return out


@dataclass(eq=False)
class ActiveFault:
    name: str
    spec: SSEProxyFault
    seed: int
    stats: Stats = field(default_factory=Stats)
    streams: int = 0

    def open_stream(self) -> FaultStream:
        # One generator per (seed, fault, stream number): a replay makes the same choices.
        rng = random.Random(f"{self.seed}:{self.name}:{self.streams}")
        self.streams += 1
        self.stats.requests += 1
        reset = self.spec.reset
        reset_after = None
        if reset is not None and rng.random() < reset.probability:
            reset_after = reset.after_events
        return FaultStream(self, rng, reset_after)


@dataclass
class FaultStream:
    """One fault as one stream sees it."""

    fault: ActiveFault
    rng: random.Random
    reset_after: int | None

    def roll(self, probability: float | None) -> bool:
        return probability is not None and self.rng.random() < probability


@dataclass
class ProxyState:
    upstream: URL
    seed: int
    connect_timeout_s: float
    read_timeout_s: float
    insecure: bool = False
    faults: dict[str, ActiveFault] = field(default_factory=dict)
    totals: Stats = field(default_factory=Stats)
    session: aiohttp.ClientSession | None = None
    _last_error_log: float = 0.0

    def log_upstream_error(self, message: str) -> None:
        # Under load a dead upstream fails every request; one line a second is enough.
        now = time.monotonic()
        if now - self._last_error_log >= 1.0:
            self._last_error_log = now
            log.warning("%s (upstream errors so far: %d)", message, self.totals.upstream_errors)


PROXY = web.AppKey("proxy", ProxyState)


# --- one proxied SSE stream ---------------------------------------------------------------------

_CONTINUE, _END, _RESET, _BROKEN = "continue", "end", "reset", "broken"


class _Stream:
    """Per-request fault bookkeeping: the faults met so far, what was forwarded, the lag."""

    def __init__(self, proxy: ProxyState) -> None:
        self.proxy = proxy
        self._mine: dict[ActiveFault, FaultStream] = {}
        self.events = 0
        self.bytes = 0
        self.lag_s = 0.0
        self.first = True

    def faults(self) -> list[FaultStream]:
        active = self.proxy.faults
        if not active:
            return []
        out = []
        for af in active.values():
            fs = self._mine.get(af)
            if fs is None:
                fs = self._mine[af] = af.open_stream()
            out.append(fs)
        return out

    def abort_status(self, faults: list[FaultStream]) -> tuple[int, str | None, str] | None:
        for fs in faults:
            abort = fs.fault.spec.abort
            if abort is not None and fs.roll(abort.probability):
                key = str(abort.status)
                for st in (fs.fault.stats, self.proxy.totals):
                    st.aborts_by_status[key] = st.aborts_by_status.get(key, 0) + 1
                return abort.status, abort.retry_after_header(), fs.fault.name
        return None

    def decide(self, ev: SSEEvent, raw: bytes, faults: list[FaultStream]) -> bytes | None:
        """Apply per-event faults: the bytes to send, or None to drop the event."""
        totals = self.proxy.totals
        totals.events_seen += 1
        content = bool(faults) and is_content_event(ev)
        for fs in faults:
            fs.fault.stats.events_seen += 1
            fs.fault.stats.content_events += content
        totals.content_events += content
        if content:
            dropped = [fs for fs in faults if fs.roll(fs.fault.spec.drop)]
            for fs in dropped:
                fs.fault.stats.events_dropped += 1
            if dropped:
                totals.events_dropped += 1
                return None
        added_s = 0.0
        for fs in faults:
            added_s += self._delays(fs)
        if added_s > 0:
            self.lag_s += added_s
            totals.delay_ms_total += added_s * 1000.0
        self.first = False
        if content:
            corrupted = [fs for fs in faults if fs.roll(fs.fault.spec.corrupt)]
            for fs in corrupted:
                fs.fault.stats.corruptions += 1
            if corrupted:
                totals.corruptions += 1
                raw = corrupt_event(raw)
        return raw

    def _delays(self, fs: FaultStream) -> float:
        spec, st, totals = fs.fault.spec, fs.fault.stats, self.proxy.totals
        added_ms = 0.0
        if self.first and spec.first_event_delay_ms is not None:
            added_ms += spec.first_event_delay_ms
            st.first_event_delays += 1
            totals.first_event_delays += 1
        if spec.delay_ms is not None and fs.roll(spec.delay_probability):
            jitter = spec.delay_jitter_ms or 0.0
            added_ms += max(0.0, spec.delay_ms + fs.rng.uniform(-jitter, jitter))
            st.events_delayed += 1
            totals.events_delayed += 1
        if spec.stall is not None and fs.roll(spec.stall.probability):
            added_ms += spec.stall.duration_ms
            st.stalls += 1
            totals.stalls += 1
        st.delay_ms_total += added_ms
        return added_ms / 1000.0

    def byte_budget(self, faults: list[FaultStream]) -> int | None:
        limits = [fs.fault.spec.truncate_after_bytes for fs in faults]
        left = [lim - self.bytes for lim in limits if lim is not None]
        return min(left) if left else None

    def limits_reached(self, faults: list[FaultStream]) -> str:
        """After each event (and at the start): has a truncation or a reset come due?"""
        for fs in faults:
            if fs.reset_after is not None and self.events >= fs.reset_after:
                fs.fault.stats.resets += 1
                self.proxy.totals.resets += 1
                return _RESET
        due = [fs for fs in faults if self._truncate_due(fs)]
        for fs in due:
            fs.fault.stats.truncations += 1
        if due:
            self.proxy.totals.truncations += 1
            return _END
        return _CONTINUE

    def _truncate_due(self, fs: FaultStream) -> bool:
        spec = fs.fault.spec
        return (spec.truncate_after_events is not None and self.events >= spec.truncate_after_events
                ) or (spec.truncate_after_bytes is not None
                      and self.bytes >= spec.truncate_after_bytes)

    def count_forwarded(self, faults: list[FaultStream], nbytes: int, event: bool) -> None:
        self.bytes += nbytes
        self.events += event
        for st in [fs.fault.stats for fs in faults] + [self.proxy.totals]:
            st.bytes += nbytes
            st.events_forwarded += event


_EOF = object()


async def _pump(upstream: aiohttp.ClientResponse, queue: asyncio.Queue[Any]) -> None:
    """Read the upstream as fast as it sends; queue each chunk's blocks with their arrival time."""
    loop = asyncio.get_running_loop()
    framer = SSEFramer()
    try:
        async for chunk in upstream.content.iter_any():
            blocks = framer.feed(chunk)
            if blocks:
                await queue.put((loop.time(), blocks, False))
        rest = framer.flush()
        if rest:
            await queue.put((loop.time(), [rest], True))
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
    """Moves one stream's events from the upstream queue to the client, faults applied.

    Each event goes out as soon as it is due. Events that are due together (they came in one
    upstream read, or the client fell behind) leave in one write: nothing waits for that.
    """

    def __init__(self, resp: web.StreamResponse, upstream: aiohttp.ClientResponse,
                 stream: _Stream) -> None:
        self.resp = resp
        self.upstream = upstream
        self.stream = stream
        self.loop = asyncio.get_running_loop()
        self.pending: list[bytes] = []

    async def run(self) -> str:
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1024)
        pump = asyncio.create_task(_pump(self.upstream, queue))
        try:
            outcome = self.stream.limits_reached(self.stream.faults())
            while outcome == _CONTINUE:
                if queue.empty():
                    await self._flush()
                item = await queue.get()
                if item is _EOF:
                    outcome = _END
                    break
                if isinstance(item, BaseException):
                    self.stream.proxy.totals.upstream_errors += 1
                    self.stream.proxy.log_upstream_error(f"upstream failed mid-stream: {item!r}")
                    outcome = _BROKEN
                    break
                arrived, blocks, tail = item
                for raw in blocks:
                    outcome = await self._step(arrived, raw, tail)
                    if outcome != _CONTINUE:
                        break
            await self._flush()
            return outcome
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _flush(self) -> None:
        if self.pending:
            data = b"".join(self.pending)
            self.pending.clear()
            await self.resp.write(data)

    async def _step(self, arrived: float, raw: bytes, tail: bool) -> str:
        stream = self.stream
        faults = stream.faults()
        ev = None if tail else parse_event(raw)
        if ev is not None:
            out = stream.decide(ev, raw, faults)
            if out is None:
                return _CONTINUE
            raw = out
        wait = arrived + stream.lag_s - self.loop.time()
        if wait > 0:
            await self._flush()
            await asyncio.sleep(wait)
        budget = stream.byte_budget(faults)
        if budget is not None and budget < len(raw):
            raw = raw[:budget]
        if raw:
            self.pending.append(raw)
        stream.count_forwarded(faults, len(raw), ev is not None)
        return stream.limits_reached(faults)


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


async def _open_upstream(request: web.Request, proxy: ProxyState
                         ) -> aiohttp.ClientResponse | web.Response:
    assert proxy.session is not None
    body = await request.read()
    url = URL(str(proxy.upstream).rstrip("/") + request.raw_path, encoded=True)
    where = f"{request.method} {request.path}"
    try:
        return await proxy.session.request(
            request.method, url, headers=_request_headers(request), data=body or None,
            allow_redirects=False,
        )
    except TimeoutError as exc:
        proxy.totals.upstream_errors += 1
        message = (f"the upstream {proxy.upstream.host}:{proxy.upstream.port} did not answer "
                   f"{where} in time ({type(exc).__name__})")
        proxy.log_upstream_error(message)
        return _error(504, message, **{"X-Streamquake-Proxy": "upstream-timeout"})
    except aiohttp.ClientError as exc:
        proxy.totals.upstream_errors += 1
        message = (f"the proxy could not get {where} from the upstream "
                   f"{proxy.upstream.host}:{proxy.upstream.port}: {exc}")
        proxy.log_upstream_error(message)
        return _error(502, message, **{"X-Streamquake-Proxy": "upstream-error"})


async def forward(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    proxy.totals.requests += 1
    stream = _Stream(proxy)
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
        outcome = await (_SSERelay(resp, upstream, stream).run() if sse
                         else _relay_raw(resp, upstream, proxy))
        if outcome == _RESET:
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
            return _error(502, f"the upstream failed: {exc!r}",
                          **{"X-Streamquake-Proxy": "upstream-error"})
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
    return _END


# --- control API --------------------------------------------------------------------------------


def _problems(exc: ValidationError) -> list[str]:
    return [f"{'.'.join(str(p) for p in e['loc']) or 'fault'}: {e['msg']}" for e in exc.errors()]


async def put_fault(request: web.Request) -> web.Response:
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
        return web.json_response({"error": f"invalid fault '{name}'", "problems": _problems(exc)},
                                 status=400)
    seed = spec.seed if spec.seed is not None else proxy.seed
    replaced = proxy.faults.pop(name, None) is not None
    proxy.faults[name] = ActiveFault(name, spec, seed)
    log.info("fault '%s' on: %s", name, json.dumps(spec.proxy_params()))
    return web.json_response({"name": name, "fault": spec.proxy_params(), "replaced": replaced})


async def delete_fault(request: web.Request) -> web.Response:
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

    async def client_session(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ssl=not state.insecure)
        timeout = aiohttp.ClientTimeout(total=None, connect=state.connect_timeout_s,
                                        sock_read=state.read_timeout_s)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=True,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
        ) as session:
            state.session = session
            yield
            state.session = None

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


async def serve(state: ProxyState, host: str, port: int) -> None:
    runner = web.AppRunner(build_app(state), access_log=None, handle_signals=False,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"LISTENING http://{_url_host(host)}:{bound}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
    finally:
        await runner.cleanup()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m streamquake.injectors.proxy_server",
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
    )
    asyncio.run(serve(state, args.host, args.port))


@dataclass
class ProxyProcess:
    """A running proxy child process; ``with`` stops it."""

    proc: subprocess.Popen[bytes]
    url: str

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
                log_path: Path | None = None) -> ProxyProcess:
    """Start the proxy as a child that dies with us; returns once it is listening."""
    args = ["--upstream", upstream_url, "--host", host, "--port", str(port), "--seed", str(seed),
            "--connect-timeout", connect_timeout, "--read-timeout", read_timeout]
    if insecure:
        args.append("--upstream-insecure")
    cmd = python_module_cmd("streamquake.injectors.proxy_server", *args)
    log_file = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    try:
        proc = spawn(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
                     env=child_env())
    finally:
        if log_file is not None:
            log_file.close()
    try:
        url = read_listening_line(proc, ready_timeout_s, "the SSE proxy")
    except BaseException:
        ProxyProcess(proc, "").stop()
        raise
    return ProxyProcess(proc, url)


if __name__ == "__main__":
    main()
