"""The embedded target: an aiohttp app that streams simulated tokens in real wire formats, at the
routes each format declares (``WireProtocol.routes``)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import IO, Any

from aiohttp import web

from streamquake import protocols
from streamquake.embedded import scheduler as sched
from streamquake.embedded.config import TargetConfig
from streamquake.embedded.formats import TOKEN_JSON, TOOL_NAME, tool_piece
from streamquake.embedded.prefix_cache import SlotCache, add_routes, prefilled
from streamquake.embedded.timing import DelaySampler, ResponsePlan, plan_response
from streamquake.errors import TargetError
from streamquake.protocols import (
    BadRequest,
    Completion,
    StreamEncoder,
    WireProtocol,
    stamp,
)

_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Tells nginx-like proxies in front of us not to buffer the stream.
    "X-Accel-Buffering": "no",
}


class SendLog:
    """The ``send_log`` file: one JSON line per stream served, appended when the stream ends.

    Lines go through a 64 KiB buffer (a stream's line is a few hundred bytes to a few KiB), so
    the per-event cost is two list appends and the file sees one write per buffer; whatever is
    buffered is written when the target stops (SIGTERM or SIGINT: the app's cleanup closes it).
    """

    def __init__(self, path: str) -> None:
        try:
            self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        except OSError as exc:
            raise TargetError(f"cannot open the send log {path!r}: {exc}") from exc

    def write(self, record: StreamRecord) -> None:
        if not self._file.closed:   # a handler cancelled at shutdown may end after the close
            self._file.write(record.line())

    def close(self) -> None:
        self._file.close()


@dataclass(slots=True)
class StreamRecord:
    """What one stream's ``send_log`` line says: the response id in its events, when the request
    arrived (handler entry) and was admitted (a capacity slot), and per write, in order, its
    epoch-ns send time (taken right before the write, the same value a ``stamp_send_time``
    comment carries) and whether it carried a content event (a token)."""

    index: int
    protocol: str
    arrived_ns: int
    admitted_ns: int | None = None
    response_id: str | None = None
    trace_id: str | None = None         # from the request's W3C traceparent, as engines log it
    sent_ns: list[int] = field(default_factory=list)
    content: list[int] = field(default_factory=list)     # 1: the write carried a token
    complete: bool = False                                # False: the client left mid-stream
    priority: int | None = None     # the request's, when a scheduler reads it (None: none does)
    preempted: int = 0              # times a P0 took its slot before its first token

    def line(self) -> str:
        return json.dumps({
            "id": self.response_id, "index": self.index, "protocol": self.protocol,
            "trace_id": self.trace_id,
            "arrived_ns": self.arrived_ns, "admitted_ns": self.admitted_ns,
            "sent_ns": self.sent_ns, "content": self.content, "complete": self.complete,
            "priority": self.priority, "preempted": self.preempted,
        }, separators=(",", ":")) + "\n"


@dataclass
class TargetState:
    """Per-process state shared by all handlers."""

    config: TargetConfig
    slots: asyncio.Semaphore
    scale: Callable[[], float] | None
    requests: int = 0
    send_log: SendLog | None = None
    cache: SlotCache | None = None
    scheduler: sched.PriorityScheduler | None = None

    def next_index(self) -> int:
        self.requests += 1
        return self.requests


STATE_KEY = web.AppKey("streamquake_target_state", TargetState)


def _gpu_scale() -> Callable[[], float]:
    """The live GPU slowdown; imported only when the flag asks, since it loads NVML."""
    from streamquake.embedded.gpu_speed import slowdown_factor  # caches its NVML reads itself

    return slowdown_factor


def _json_error(fmt: WireProtocol, status: int, message: str) -> web.Response:
    return web.json_response(fmt.error_body(status, message), status=status)


async def _read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def _write_stamped(resp: web.StreamResponse, frame: bytes) -> None:
    # The send time is read here, as late as it can be: nothing runs between it and the write.
    await resp.write(stamp(frame))


async def _write_logged(
    resp: web.StreamResponse, record: StreamRecord, stamped: bool, content: int, frame: bytes
) -> None:
    sent = time.time_ns()
    if stamped:
        frame = stamp(frame, sent)
    record.sent_ns.append(sent)
    record.content.append(content)
    await resp.write(frame)


async def _generate(
    resp: web.StreamResponse,
    enc: StreamEncoder,
    plan: ResponsePlan,
    delays: DelaySampler,
    record: StreamRecord | None = None,
    reasoning_tokens: int = 0,
    first_wait: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    if record is None:
        write = functools.partial(_write_stamped, resp) if enc.stamp_send_time else resp.write
        write_token = write
    else:
        write = functools.partial(_write_logged, resp, record, enc.stamp_send_time, 0)
        write_token = functools.partial(_write_logged, resp, record, enc.stamp_send_time, 1)
    opening = enc.opening()
    if opening:
        await write(opening)
    # The answer's parts: reasoning first, then text or a tool call's arguments.
    thinking = min(reasoning_tokens, len(plan.tokens))
    last = len(plan.tokens) - 1
    # Absolute deadlines: a late wake-up shortens the next gap instead of shifting the rest.
    deadline = start + delays.ttft_s()
    for i, tok in enumerate(plan.tokens):
        if i:
            deadline += delays.itl_s()
        wait = deadline - loop.time()
        if not i and first_wait is not None:
            # The scheduler's wait: a P0 may evict this stream and it waits again.
            await first_wait(wait)
            deadline = loop.time()
        elif wait > 0:
            await asyncio.sleep(wait)
        if i < thinking:
            await write_token(enc.reasoning(TOKEN_JSON[tok]))
        elif enc.tool_name is not None:
            # A format that sends a call whole (Gemini) writes nothing until its last piece.
            closes = i == last and not plan.truncated
            frame = enc.tool_args(tool_piece(tok, i == thinking, closes), i == thinking, closes)
            if frame:
                await write_token(frame)
        else:
            await write_token(enc.token(TOKEN_JSON[tok]))
    await write(enc.closing(Completion(len(plan.tokens), plan.truncated)))
    await resp.write_eof()


async def _stream(request: web.Request, fmt: WireProtocol, model: str | None) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    arrived_ns = time.time_ns() if state.send_log is not None else 0
    cfg = state.config
    try:
        body = await _read_json(request)
        gen = fmt.parse(body, model)
        priority = _priority(body) if state.scheduler is not None else None
    except BadRequest as exc:
        return _json_error(fmt, 400, str(exc))
    index = state.next_index()
    plan, rng = plan_response(cfg, index, gen.max_tokens)
    if plan.fail:
        return _json_error(fmt, 500, "simulated server error (error_rate)")
    resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Streamquake-Request": str(index)})
    record = None if state.send_log is None else StreamRecord(
        index, fmt.name, arrived_ns, trace_id=_trace_id(request.headers.get("traceparent")),
        priority=priority)
    admission: AbstractAsyncContextManager[Any] = state.slots
    first_wait = ticket = None
    if state.scheduler is not None and priority is not None:
        ticket = state.scheduler.ticket(priority)
        admission = sched.slot(state.scheduler, ticket)
    try:
        await resp.prepare(request)
        # Queue wait counts toward TTFT: the clock for the first token starts at admission.
        # The prefill of what the prompt cache lacks counts toward TTFT too (prefix_cache).
        async with admission, prefilled(state.cache, gen.prompt) as prefill:
            delays = DelaySampler(cfg.ttft, cfg.itl, rng, state.scale)
            if ticket is not None and state.scheduler is not None:
                first_wait = functools.partial(state.scheduler.form, ticket, again=delays.ttft_s)
            enc = fmt.encoder(gen, cfg.sse_event_ids)
            enc.stamp_send_time = cfg.stamp_send_time
            enc.reasoning_first = cfg.reasoning_tokens > 0 and bool(plan.tokens)
            enc.tool_name = TOOL_NAME if cfg.tool_call else None
            enc.timings = prefill.timings() if prefill is not None else None
            if record is not None:
                record.admitted_ns = time.time_ns()
                record.response_id = enc.response_id
            await _generate(resp, enc, plan, delays, record, cfg.reasoning_tokens, first_wait)
            if record is not None:
                record.complete = True
    except ConnectionResetError:
        pass  # the client left mid-stream; leaving the semaphore block freed its slot
    finally:
        # Also when the handler is cancelled (the client hung up): what was sent is logged.
        if record is not None and state.send_log is not None:
            if ticket is not None:
                record.preempted = ticket.preemptions
            state.send_log.write(record)
    return resp


def _priority(body: object) -> int:
    """A request's ``priority`` body field (vLLM's: 0 is served first), 0 when absent."""
    value = body.get("priority", 0) if isinstance(body, dict) else 0
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
        raise BadRequest(f"'priority' must be an integer from 0 (served first) to 3, "
                         f"got {value!r}")
    return value


def _trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``), if it is one."""
    m = _TRACEPARENT.fullmatch(traceparent.strip()) if traceparent else None
    return m[1] if m and m[1] != "0" * 32 else None


def _stream_handler(
    fmt: WireProtocol,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            model = fmt.url_model(request.match_info, request.query, request.path)
        except BadRequest as exc:
            return _json_error(fmt, exc.status, str(exc))
        return await _stream(request, fmt, model)

    return handle


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(config: TargetConfig) -> web.Application:
    """The aiohttp application serving the protocols named in ``config.protocols``."""
    app = web.Application()
    scale = _gpu_scale() if config.gpu_clock_scale else None
    send_log = SendLog(config.send_log) if config.send_log is not None else None
    cache = SlotCache(config.prefix_cache) if config.prefix_cache is not None else None
    scheduler = None if config.scheduler is None else sched.PriorityScheduler(
        config.capacity, config.scheduler)
    app[STATE_KEY] = TargetState(
        config=config, slots=asyncio.Semaphore(config.capacity), scale=scale, send_log=send_log,
        cache=cache, scheduler=scheduler,
    )
    if cache is not None:
        add_routes(app, cache)
    if scheduler is not None:
        sched.add_routes(app, scheduler)
    if send_log is not None:
        log = send_log

        async def close_send_log(app: web.Application) -> None:
            log.close()

        app.on_cleanup.append(close_send_log)
    app.router.add_get("/healthz", _healthz)
    enabled = set(config.protocols)
    for name in protocols.names():
        if name in enabled:
            fmt = protocols.get(name)
            for route in fmt.routes():
                app.router.add_route(route.method, route.path,
                                     _stream_handler(route.speaks or fmt))
    return app


def ssl_context(config: TargetConfig) -> ssl.SSLContext | None:
    if not (config.tls_cert and config.tls_key):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise TargetError(
            f"cannot load TLS certificate {config.tls_cert!r} / key {config.tls_key!r}: {exc}"
        ) from exc
    return ctx


def url_for(scheme: str, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


async def start_server(
    config: TargetConfig, host: str, port: int
) -> tuple[web.AppRunner, str]:
    """Bind and serve; returns the runner (``await runner.cleanup()`` to stop) and the URL."""
    tls = ssl_context(config)
    # handler_cancellation: a client that hangs up cancels its handler, so a queued or
    # generating stream gives its capacity slot back at once. No access log: it would print
    # query strings, and ?key= carries an API key.
    runner = web.AppRunner(
        build_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
    )
    await runner.setup()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        await runner.cleanup()
        raise TargetError(f"cannot listen on {host}:{port}: {exc}") from exc
    site = web.SockSite(runner, sock, ssl_context=tls, backlog=1024)
    await site.start()
    bound_port = sock.getsockname()[1]
    return runner, url_for("https" if tls else "http", host, bound_port)
