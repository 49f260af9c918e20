"""The SSE proxy in front of an upstream that closes every connection after one answer while
saying ``Keep-Alive`` (llama-server does): the proxy's pool holds connections the peer is
closing, and no request may fail for that. Real processes and sockets on loopback; the upstream
is a raw asyncio server here, so that its connection habits are exact."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from streamquake.faults.proxy.server import ProxyProcess, start_proxy
from tests.conftest import run_cli
from tests.helpers import assert_run_ok
from tests.test_sse_proxy import Seen, chat, control, fetch

TOKENS = 8
_CHUNK = b'{"id":"c1","object":"chat.completion.chunk","model":"sim","choices":[{"index":0,'
EVENTS = (
    [b"data: " + _CHUNK + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}']
    + [b"data: " + _CHUNK + b'"delta":{"content":"t "},"finish_reason":null}]}'] * TOKENS
    + [b"data: " + _CHUNK + b'"delta":{},"finish_reason":"stop"}]}', b"data: [DONE]"]
)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
KEEP_ALIVE = b"Connection: keep-alive\r\nKeep-Alive: timeout=5, max=100\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    """One upstream connection: answers one request at a time, by path (see ClosingUpstream)."""

    def __init__(self, up: ClosingUpstream) -> None:
        self.up = up
        self.buf = b""
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:])
                       if k.strip().lower() == "content-length"), 0)
        if len(rest) < length:
            return
        self.buf, self.busy = rest[length:], True
        path = lines[0].split(" ")[1]
        self.up.received[path.split("?")[0]] += 1
        asyncio.ensure_future(self._answer(path))

    async def _answer(self, path: str) -> None:
        assert self.transport is not None
        if path.startswith("/v1/hang-up"):
            self.transport.close()
            return
        if path.startswith("/v1/half-answer"):
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            await asyncio.sleep(0.01)
            self.transport.close()
            return
        self.transport.write(HEAD + (b"Connection: close\r\n\r\n" if self.up.say_close
                                     else KEEP_ALIVE))
        for event in EVENTS:
            self.transport.write(_chunk(event + b"\n\n"))
        self.transport.write(b"0\r\n\r\n")
        self.up.answered += 1
        if path.endswith("?keep=1"):
            self.busy = False
            self._next()
            return
        await asyncio.sleep(self.up.rng.uniform(0, self.up.linger_s))
        if self.buf:
            # A request came in after the answer. llama-server never reads it, so the kernel
            # answers the close with a RST.
            self.up.unanswered += 1
            sock = self.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
        else:
            self.transport.close()


class ClosingUpstream:
    """llama-server's connection habit: chunked OpenAI SSE, ``Connection: keep-alive`` and
    ``Keep-Alive: timeout=5, max=100``, and the connection closed up to ``linger_s`` after the
    last chunk (the wider that window, the likelier a pooled connection is reused as it closes).
    ``?keep=1`` keeps the connection instead; ``/v1/hang-up`` closes without a byte;
    ``/v1/half-answer`` closes halfway through the response headers; ``say_close`` says
    ``Connection: close`` instead of keep-alive. On its own thread."""

    def __init__(self, linger_s: float = 0.02, seed: int = 1, say_close: bool = False) -> None:
        self.linger_s = linger_s
        self.say_close = say_close
        self.rng = random.Random(seed)
        self.received: Counter[str] = Counter()
        self.answered = 0
        self.unanswered = 0   # requests that met a close (a RST) instead of an answer
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> ClosingUpstream:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            self._loop.create_server(lambda: _Conn(self), "127.0.0.1", 0), self._loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def upstream() -> Iterator[ClosingUpstream]:
    with ClosingUpstream() as up:
        yield up


def _complete(seen: Seen) -> bool:
    return seen.status == 200 and seen.error is None and seen.data()[-1:] == [b"[DONE]"]


def _totals(proxy: ProxyProcess) -> dict[str, int]:
    return dict(control(proxy, "GET", "/stats")[1]["totals"])


def _drive(proxy: ProxyProcess) -> list[Seen]:
    """40 requests one after another, then 80 from 8 threads at once."""
    def one(_: int) -> Seen:
        return fetch(proxy.url, "/v1/chat/completions", chat(TOKENS))

    seen = [one(i) for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        seen += pool.map(one, range(80))
    return seen


@pytest.mark.timeout(120)
def test_an_upstream_closing_after_each_answer_meets_no_proxy_errors(
    upstream: ClosingUpstream,
) -> None:
    with start_proxy(upstream.url) as proxy:
        seen = _drive(proxy)
        totals = _totals(proxy)
    statuses = Counter(s.status for s in seen)
    assert all(_complete(s) for s in seen), statuses
    # Not vacuous: requests did land on connections the upstream was closing...
    assert upstream.unanswered >= 1
    # ...and each was sent again, on a fresh connection, before any answer came back: every
    # request was answered once, none twice.
    assert upstream.answered == len(seen) == 120
    assert totals["upstream_retries"] >= upstream.unanswered
    assert totals["proxy_errors"] == totals["upstream_errors"] == 0


@pytest.mark.timeout(120)
def test_an_upstream_saying_close_is_not_pooled() -> None:
    with ClosingUpstream(say_close=True) as upstream, start_proxy(upstream.url) as proxy:
        seen = _drive(proxy)
        totals = _totals(proxy)
    assert all(_complete(s) for s in seen), Counter(s.status for s in seen)
    # No request ever went out on a connection after an answer that said close.
    assert upstream.unanswered == totals["upstream_retries"] == totals["proxy_errors"] == 0
    assert upstream.answered == 120


@pytest.mark.timeout(60)
def test_only_a_reused_connection_that_gave_no_answer_is_retried(
    upstream: ClosingUpstream,
) -> None:
    with start_proxy(upstream.url) as proxy:
        # A fresh connection the upstream drops unanswered: its own error, told as such.
        fresh = fetch(proxy.url, "/v1/hang-up", chat(1))
        assert upstream.received["/v1/hang-up"] == 1
        # A reused connection that broke after response bytes came: the request reached the
        # upstream, so it is never sent again.
        assert _complete(fetch(proxy.url, "/v1/chat/completions?keep=1", chat(TOKENS)))
        half = fetch(proxy.url, "/v1/half-answer", chat(1))
        assert upstream.received["/v1/half-answer"] == 1
        # A reused connection closed without a byte is retried once, on a fresh one; when
        # that fails too, the failure is the upstream's.
        assert _complete(fetch(proxy.url, "/v1/chat/completions?keep=1", chat(TOKENS)))
        again = fetch(proxy.url, "/v1/hang-up", chat(1))
        assert upstream.received["/v1/hang-up"] == 3
        totals = _totals(proxy)
    for failed in (fresh, half, again):
        assert failed.status == 502, failed.body
        assert failed.headers["X-Streamquake-Proxy"] == "upstream-error"
        assert json.loads(failed.body)["error"]["source"] == "streamquake-proxy"
    assert totals["upstream_retries"] == 1
    assert totals["proxy_errors"] == totals["upstream_errors"] == 3


SCENARIO = """
name: closing-upstream
target:
  protocol: openai
  url: {url}
  timeout: 10s
load:
  users: 6
  think_time: {{min: 0ms, max: 20ms}}
  seed: 3
phases: {{warmup: 1s, baseline: 4s, fault: 3s, recovery: 4s}}
faults:
  - {{type: sse_proxy, name: slow-start, phase: fault, first_event_delay: 50ms}}
"""


@pytest.mark.timeout(150)
def test_a_run_through_the_proxy_has_no_errors_outside_the_fault(
    tmp_path: Path, state_dir: Path, upstream: ClosingUpstream,
) -> None:
    scenario = tmp_path / "closing.yaml"
    scenario.write_text(SCENARIO.format(url=upstream.url))
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=140)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p["stats"] for p in report["phases"]}
    for name in ("baseline", "fault", "recovery"):
        assert phases[name]["requests"] >= 10, phases[name]
        assert sum(phases[name]["errors"].values()) == 0, (name, phases[name]["errors"])
    assert upstream.unanswered >= 1  # the race was met, and did no harm
    proxy = report["telemetry"]["sse_proxy"]["totals"]
    assert proxy["upstream_retries"] >= upstream.unanswered
    assert proxy["proxy_errors"] == 0
    assert proxy["requests"] == upstream.answered  # each answered once, none twice

