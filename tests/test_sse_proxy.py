"""The SSE fault proxy, measured from the outside: real proxy processes on loopback, the embedded
target (or a tiny upstream in this file where exact bytes or pacing matter), and a small
blocking streaming client that timestamps every event as it arrives."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.errors import InjectorError
from streamquake.faults.catalog import fault_type
from streamquake.faults.contract import RunContext
from streamquake.faults.proxy.framing import (
    SSEFramer,
    count_events,
    is_content_event,
    parse_event,
)
from streamquake.faults.proxy.injector import SSEProxyInjector
from streamquake.faults.proxy.resources import FaultProxy
from streamquake.faults.proxy.server import ProxyProcess, start_proxy
from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.journal import Journal

# --- a tiny upstream, for exact bytes, pacing and hit counting ----------------------------------

# Every SSE line ending, a comment block, a multi-line data field, CRLF split across writes and
# a last event without its blank line.
RAW_SSE = (
    b": keep-alive comment\n\n"
    b'id: 1\r\ndata: {"text": "a"}\r\n\r\n'
    b'id: 2\rdata: {"text": "b"}\r\r'
    b"event: note\ndata: line one\ndata: line two\n\n"
    b'id: 3\r\ndata: {"text": "c"}\n\r\n'
    b"data: tail without its blank line"
)
RAW_SSE_EVENTS = 4  # the comment block and the unterminated tail are not events
RAW_SPLITS = (7, 28, 40, 51, 58, 78, 79, 128, 150, 170)  # 28, 51: between a CR and its LF


class TinyUpstream:
    """An aiohttp server on its own thread and loop."""

    def __init__(self) -> None:
        self.hits = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> str:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.url

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/raw-sse", self._raw_sse)
        app.router.add_get("/paced", self._paced)
        app.router.add_get("/slow-headers", self._slow_headers)
        app.router.add_route("*", "/echo/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def _raw_sse(self, request: web.Request) -> web.StreamResponse:
        resp = await self._sse(request)
        edges = (0, *RAW_SPLITS, len(RAW_SSE))
        for a, b in zip(edges, edges[1:], strict=False):
            await resp.write(RAW_SSE[a:b])
            await asyncio.sleep(0.01)  # separate TCP segments
        await resp.write_eof()
        return resp

    async def _paced(self, request: web.Request) -> web.StreamResponse:
        n, gap = int(request.query["n"]), float(request.query["gap_ms"]) / 1000
        resp = await self._sse(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(1, n + 1):
            await asyncio.sleep(max(0.0, start + (i - 1) * gap - loop.time()))
            await resp.write(b'id: %d\ndata: {"text": "t%d"}\n\n' % (i, i))
        await resp.write_eof()
        return resp

    async def _slow_headers(self, request: web.Request) -> web.Response:
        self.hits += 1
        await asyncio.sleep(3)
        return web.Response(text="late")

    async def _echo(self, request: web.Request) -> web.Response:
        self.hits += 1
        body = await request.read()
        return web.json_response({
            "method": request.method,
            "path_qs": request.path_qs,
            "body": body.decode(),
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }, headers={"X-Upstream": "tiny", "Set-Cookie": "a=1"})


# --- a streaming client that timestamps events ---------------------------------------------------

_BLANK = re.compile(rb"\r?\n\r?\n")
_ID = re.compile(rb"^id: ?(\d+)", re.M)
_DATA = re.compile(rb"^data: ?(.*?)\r?$", re.M)


@dataclass
class Seen:
    status: int
    headers: http.client.HTTPMessage
    body: bytes = b""
    events: list[tuple[float, bytes]] = field(default_factory=list)  # (ms after send, raw)
    error: BaseException | None = None

    def ids(self) -> list[int]:
        return [int(m[1]) for _, raw in self.events if (m := _ID.search(raw))]

    def data(self) -> list[bytes]:
        return [m[1] for _, raw in self.events if (m := _DATA.search(raw))]

    def times(self) -> list[float]:
        return [t for t, _ in self.events]

    def gaps(self) -> list[float]:
        ts = self.times()
        return [b - a for a, b in zip(ts, ts[1:], strict=False)]


def fetch(base: str, path: str, body: Any = None, method: str | None = None,
          headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Seen:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout_s)
    payload = None if body is None else json.dumps(body).encode()
    sent = time.perf_counter()
    conn.request(method or ("GET" if body is None else "POST"), path, body=payload,
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    seen = Seen(resp.status, resp.headers)
    buf = b""
    try:
        while chunk := resp.read1(65536):
            now_ms = (time.perf_counter() - sent) * 1000
            seen.body += chunk
            buf += chunk
            while m := _BLANK.search(buf):
                seen.events.append((now_ms, buf[: m.end()]))
                buf = buf[m.end():]
    except (ConnectionResetError, http.client.IncompleteRead) as exc:
        seen.error = exc
    finally:
        conn.close()
    return seen


def chat(tokens: int) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": tokens}


def control(proxy: ProxyProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(proxy.control_url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def put(proxy: ProxyProcess, name: str, **params: Any) -> dict[str, Any]:
    status, answer = control(proxy, "PUT", f"/faults/{name}", params)
    assert status == 200, answer
    return dict(answer)


def delete(proxy: ProxyProcess, name: str) -> dict[str, Any]:
    status, answer = control(proxy, "DELETE", f"/faults/{name}")
    assert status == 200, answer
    return dict(answer)


# --- fixtures: one target, one tiny upstream, a proxy in front of each --------------------------


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    cfg = TargetConfig.model_validate(
        {"ttft": "20ms", "itl": "0ms", "output_tokens": {"min": 200, "max": 200},
         "sse_event_ids": True}
    )
    with start_target(cfg) as t:
        yield t


@pytest.fixture(scope="module")
def proxy(target: TargetProcess) -> Iterator[ProxyProcess]:
    with start_proxy(target.url, seed=7) as p:
        yield p


@pytest.fixture(scope="module")
def tiny() -> Iterator[TinyUpstream]:
    up = TinyUpstream()
    up.start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def tiny_proxy(tiny: TinyUpstream) -> Iterator[ProxyProcess]:
    with start_proxy(tiny.url, read_timeout="1s") as p:
        yield p


@pytest.fixture(autouse=True)
def _no_faults_left(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("proxy", "tiny_proxy"):
        if name in request.fixturenames:
            p = request.getfixturevalue(name)
            _, answer = control(p, "GET", "/faults")
            for fault in answer["faults"]:
                delete(p, fault)


# --- framing and content rules (no processes) ---------------------------------------------------


@pytest.mark.timeout(10)
def test_framer_finds_the_same_events_whatever_the_chunking() -> None:
    whole = SSEFramer()
    blocks = whole.feed(RAW_SSE)
    assert b"".join(blocks) + whole.flush() == RAW_SSE
    assert sum(parse_event(b) is not None for b in blocks) == RAW_SSE_EVENTS
    for cut in range(len(RAW_SSE) + 1):
        f = SSEFramer()
        assert f.feed(RAW_SSE[:cut]) + f.feed(RAW_SSE[cut:]) == blocks, cut
    bytewise = SSEFramer()
    assert [b for i in range(len(RAW_SSE)) for b in bytewise.feed(RAW_SSE[i:i + 1])] == blocks
    note = parse_event(blocks[3])
    assert note is not None and note.name == b"note" and note.data == b"line one\nline two"


def _blocks_by_the_rule(stream: bytes) -> list[bytes]:
    """The spec's cut, on the whole stream at once: a block ends with its first blank line."""
    blocks, start, line = [], 0, 0
    for m in re.finditer(rb"\r\n|\r|\n", stream):
        if m.start() == line:
            blocks.append(stream[start:m.end()])
            start = m.end()
        line = m.end()
    return blocks


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from([b"data: x", b": c", b"a", b"\n", b"\n\n", b"\r", b"\r\n",
                                       b"\n\n\n"]), max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
       lf_only=st.booleans())
def test_framer_cuts_any_stream_by_the_blank_line_rule(parts: list[bytes], cuts: list[int],
                                                        lf_only: bool) -> None:
    # The LF-only fast path and the every-line-ending path cut alike, wherever reads end; the
    # joined form holds the same blocks, and its event count is parse_event's.
    stream = b"".join(p for p in parts if not (lf_only and b"\r" in p))
    edges = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    framer = SSEFramer()
    got = []
    for a, b in zip(edges, edges[1:], strict=False):
        data, ends = framer.feed_joined(stream[a:b])
        blocks = [data[i:j] for i, j in zip([0, *ends], ends, strict=False)]
        assert b"".join(blocks) == data
        assert count_events(data, ends) == sum(parse_event(b) is not None for b in blocks)
        got += blocks
    # A CR at the very end waits: it may be the first half of a CRLF.
    want = _blocks_by_the_rule(stream[:-1] if stream.endswith(b"\r") else stream)
    assert got == want
    assert b"".join(got) + framer.flush() == stream


@pytest.mark.timeout(30)
def test_the_proxy_process_does_not_import_its_control_client() -> None:
    # server -> injector -> resources -> server was a circle: the constants they share live
    # below all three.
    code = ("import sys, streamquake.faults.proxy.server\n"
            "print(sorted(m for m in sys.modules if m.startswith('streamquake.faults.proxy.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    assert "streamquake.faults.proxy.server" in out
    assert "injector" not in out and "resources" not in out, out


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("raw", "content"), [
    (b'data: {"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
     False),
    (b'data: {"choices":[{"delta":{"content":"hi "},"finish_reason":null}]}\n\n', True),
    (b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n', False),
    (b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n', False),
    (b"data: [DONE]\n\n", False),
    (b'event: message_start\ndata: {"type":"message_start","message":{"content":[]}}\n\n', False),
    (b'event: content_block_delta\ndata: {"delta":{"type":"text_delta","text":"x"}}\n\n', True),
    (b'event: ping\ndata: {"type":"ping"}\n\n', False),
    (b'event: message_delta\ndata: {"delta":{"stop_reason":"end_turn"}}\n\n', False),
    (b'data: {"candidates":[{"content":{"parts":[{"text":"yo"}]}}],"usageMetadata":{}}\r\n\r\n',
     True),
    (b'data: {"candidates":[{"content":{"parts":[{"text":""}]},"finishReason":"STOP"}]}\n\n',
     False),
    (b'data: {"text":"w "}\n\n', True),
    (b'data: {"done":true,"usage":{"output_tokens":3}}\n\n', False),
    (b'data: {"error":{"message":"overloaded","text":"x"}}\n\n', False),
    (b"data: plain words\n\n", True),
    (b": just a comment\n\n", False),
    # JSON the strict parser refuses and the standard library reads: still read, not "text".
    (b'data: {"text":"x","finish_reason":"stop","n":NaN}\n\n', False),
])
def test_content_events_are_chosen_conservatively(raw: bytes, content: bool) -> None:
    ev = parse_event(raw)
    assert (ev is not None and is_content_event(ev)) is content


@pytest.mark.timeout(10)
def test_fault_model_takes_human_units_and_explains_mistakes() -> None:
    f = SSEProxyFault.model_validate({
        "type": "sse_proxy", "name": "x", "drop": "15%", "delay": "200ms",
        "delay_jitter": "50ms", "stall": {"probability": "5%", "duration": "1s"},
        "abort": {"status": 429, "retry_after": "1500ms"}, "truncate_after_bytes": "2kb",
    })
    assert (f.drop, f.delay_ms, f.delay_jitter_ms) == (0.15, 200.0, 50.0)
    assert f.stall is not None and f.stall.duration_ms == 1000.0
    assert f.abort is not None and f.abort.retry_after_header() == "2"
    assert f.truncate_after_bytes == 2048
    bad: list[tuple[dict[str, Any], str]] = [
        ({"drop": "150%"}, "drop"),
        ({"delay": "-5ms"}, "delay"),
        ({"first_event_delay": "0ms"}, "positive duration"),
        ({"delay_jitter": "5ms", "drop": 0.1}, "delay_jitter needs delay"),
        ({}, "at least one action"),
        ({"drop": 0.1, "dorp": 0.1}, "dorp"),
        ({"stall": {"probability": 2, "duration": "1s"}}, "probability"),
        ({"abort": {"status": 200}}, "status"),
        ({"reset": {"after_events": -1}}, "after_events"),
    ]
    for params, needle in bad:
        with pytest.raises(ValidationError) as info:
            SSEProxyFault.model_validate({"type": "sse_proxy", **params})
        assert needle in str(info.value), (params, str(info.value))


# --- passthrough -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_passthrough_is_byte_identical(tiny: TinyUpstream, tiny_proxy: ProxyProcess) -> None:
    direct = fetch(tiny.url, "/raw-sse")
    proxied = fetch(tiny_proxy.url, "/raw-sse")
    assert direct.body == proxied.body == RAW_SSE
    # With a fault active (one that never fires) the bytes are still the same, and the proxy's
    # framing saw exactly the events in them, across the awkward write boundaries.
    put(tiny_proxy, "count", truncate_after_events=1000)
    assert fetch(tiny_proxy.url, "/raw-sse").body == RAW_SSE
    stats = delete(tiny_proxy, "count")["stats"]
    assert stats["events_seen"] == RAW_SSE_EVENTS and stats["truncations"] == 0

    path = "/echo/some/where?q=1&key=secret%20x"
    want = fetch(tiny.url, path, {"a": [1, 2]}, method="PATCH", headers={"X-Custom": "v"})
    got = fetch(tiny_proxy.url, path, {"a": [1, 2]}, method="PATCH",
                headers={"X-Custom": "v", "Connection": "keep-alive, X-Hop", "X-Hop": "h"})
    sent, seen = json.loads(want.body), json.loads(got.body)
    assert seen["method"] == "PATCH" and seen["path_qs"] == sent["path_qs"]
    assert seen["body"] == sent["body"] == '{"a": [1, 2]}'
    assert seen["headers"]["x-custom"] == "v"
    assert "x-hop" not in seen["headers"]  # named in Connection: hop-by-hop
    assert got.headers["X-Upstream"] == "tiny" and got.headers["Set-Cookie"] == "a=1"


@pytest.mark.timeout(30)
def test_passthrough_is_unbuffered(tiny_proxy: ProxyProcess) -> None:
    # Sent at 0, 100, ..., 500 ms. Buffered, they would arrive together: the first no earlier
    # than the last was sent, gaps near 0 ms. A gap under 50 ms needs one event held up 50 ms
    # more than the next, which no busy machine does to a stream passed through as it comes.
    seen = fetch(tiny_proxy.url, "/paced?n=6&gap_ms=100")
    assert seen.ids() == [1, 2, 3, 4, 5, 6]
    assert seen.times()[0] < seen.times()[-1] - 400, seen.times()
    assert all(gap >= 50 for gap in seen.gaps()), seen.gaps()


@pytest.mark.timeout(30)
def test_passthrough_counts_what_it_passed_unparsed(tiny_proxy: ProxyProcess) -> None:
    # With no fault on, reads pass through whole; the totals still count events as the
    # per-event path does (the comment block and the unended tail are no events).
    before = control(tiny_proxy, "GET", "/stats")[1]["totals"]
    assert fetch(tiny_proxy.url, "/raw-sse").body == RAW_SSE
    after = control(tiny_proxy, "GET", "/stats")[1]["totals"]
    for key, grew in (("events_seen", RAW_SSE_EVENTS), ("events_forwarded", RAW_SSE_EVENTS),
                      ("bytes", len(RAW_SSE))):
        assert after[key] - before[key] == grew, key


@pytest.mark.timeout(30)
def test_a_held_event_does_not_bunch_the_ones_behind_it(tiny_proxy: ProxyProcess) -> None:
    # Sent 100 ms apart; the first is held 300 ms. Those that come while it waits are each
    # held from their own arrival, so they leave 100 ms apart too. Stamped only when read after
    # the wait, the second and third would leave together (and the rest in bunches).
    put(tiny_proxy, "late-start", first_event_delay="300ms")
    plain = fetch(tiny_proxy.url, "/paced?n=6&gap_ms=100")
    delete(tiny_proxy, "late-start")
    assert plain.ids() == [1, 2, 3, 4, 5, 6]
    assert all(gap >= 50 for gap in plain.gaps()), plain.gaps()


@pytest.mark.timeout(30)
def test_upstream_failures_are_clear(tiny_proxy: ProxyProcess, tiny: TinyUpstream) -> None:
    slow = fetch(tiny_proxy.url, "/slow-headers")
    assert slow.status == 504 and b"did not answer" in slow.body
    # The upstream falls silent mid-stream beyond the read timeout: no clean end.
    broken = fetch(tiny_proxy.url, "/paced?n=2&gap_ms=1500")
    assert broken.ids() == [1]
    assert isinstance(broken.error, http.client.IncompleteRead | ConnectionResetError)
    with start_proxy("http://127.0.0.1:9", connect_timeout="2s") as dead:
        refused = fetch(dead.url, "/anything")
    assert refused.status == 502 and b"could not get GET /anything" in refused.body
    assert refused.headers["X-Streamquake-Proxy"] == "upstream-error"


# --- faults, measured by the client ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_drop_15_percent_is_seen_as_chunk_loss(proxy: ProxyProcess) -> None:
    put(proxy, "loss", drop="15%", seed=3)
    missing = content = 0
    for _ in range(12):
        seen = fetch(proxy.url, "/v1/chat/completions", chat(200))
        ids = seen.ids()
        last = ids[-1]  # [DONE] is never dropped, so the last id is the count sent
        missing += last - len(ids)
        content += last - 3  # minus the role chunk, the finish chunk and [DONE]
        first, finish = json.loads(seen.data()[0]), json.loads(seen.data()[-2])
        assert first["choices"][0]["delta"]["role"] == "assistant"
        assert finish["choices"][0]["finish_reason"] == "stop"
        assert seen.data()[-1] == b"[DONE]"
    stats = delete(proxy, "loss")["stats"]
    assert content == 2400
    assert 0.12 <= missing / content <= 0.18, missing / content
    assert stats["events_dropped"] == missing and stats["content_events"] == content
    assert stats["requests"] == 12


@pytest.mark.timeout(30)
def test_first_event_delay_shifts_the_first_event(proxy: ProxyProcess) -> None:
    def first_ms() -> float:
        return statistics.median(
            fetch(proxy.url, "/v1/chat/completions", chat(5)).times()[0] for _ in range(3)
        )

    before = first_ms()
    plain = fetch(proxy.url, "/v1/chat/completions", chat(5))
    put(proxy, "ttft", first_event_delay="300ms")
    after = first_ms()
    seen = fetch(proxy.url, "/v1/chat/completions", chat(5))
    stats = delete(proxy, "ttft")["stats"]
    # Shifted by the delay: its 300 ms never shortened by much (a median of three); a delay
    # counted twice (or added per event) would be 300 ms more, not half that.
    assert 250 <= after - before < 300 + 150, (before, after)
    # The rest of the stream follows the first event as it did without the fault, not each
    # event 300 ms later.
    span, plain_span = (f.times()[-1] - f.times()[0] for f in (seen, plain))
    assert span < plain_span + 150, (span, plain_span)
    assert stats["first_event_delays"] == 4


@pytest.mark.timeout(30)
def test_delay_and_jitter_show_in_the_gaps(proxy: ProxyProcess) -> None:
    plain = fetch(proxy.url, "/v1/chat/completions", chat(20)).gaps()    # the target's own
    put(proxy, "slow", delay="40ms", delay_jitter="20ms", seed=1)
    seen = fetch(proxy.url, "/v1/chat/completions", chat(20))
    stats = delete(proxy, "slow")["stats"]
    gaps = seen.gaps()
    assert len(gaps) == 22  # role chunk, 20 tokens, finish, [DONE]
    # Each event waits 20-60 ms (median 40): the median gap is at least the shortest wait and
    # at most the longest on top of the median gap the same stream had without the fault,
    # measured right here. Medians, not the extremes or the mean: a busy machine that reads one
    # event late shortens the next gap and lengthens this one, and moves a median by neither.
    assert 20 <= statistics.median(gaps) <= 60 + statistics.median(plain), (gaps, plain)
    assert statistics.pstdev(gaps) > 5, gaps  # uniform +-20 ms: sd ~ 11.5 ms
    assert stats["events_delayed"] == 23


@pytest.mark.timeout(30)
def test_stall_pauses_the_stream(proxy: ProxyProcess) -> None:
    put(proxy, "stall", stall={"probability": "10%", "duration": "250ms"}, seed=2)
    seen = fetch(proxy.url, "/v1/chat/completions", chat(30))
    stats = delete(proxy, "stall")["stats"]
    long_gaps = [g for g in seen.gaps() if g >= 240]
    assert stats["stalls"] >= 1
    # The first event's own stall hides in the time to first event; the others are gaps.
    assert len(long_gaps) in (stats["stalls"] - 1, stats["stalls"]), (seen.gaps(), stats)
    assert len(seen.ids()) == 33


@pytest.mark.timeout(30)
def test_truncation_ends_the_stream_cleanly(proxy: ProxyProcess) -> None:
    put(proxy, "cut", truncate_after_events=5)
    seen = fetch(proxy.url, "/v1/chat/completions", chat(50))
    assert seen.ids() == [1, 2, 3, 4, 5] and seen.error is None
    assert delete(proxy, "cut")["stats"]["truncations"] == 1
    put(proxy, "cut-bytes", truncate_after_bytes=1000)
    seen = fetch(proxy.url, "/v1/chat/completions", chat(50))
    assert len(seen.body) == 1000 and seen.error is None
    assert delete(proxy, "cut-bytes")["stats"]["bytes"] == 1000


@pytest.mark.timeout(30)
def test_abort_answers_without_the_upstream(tiny: TinyUpstream, tiny_proxy: ProxyProcess) -> None:
    hits = tiny.hits
    put(tiny_proxy, "busy", abort={"status": 503})
    unavailable = fetch(tiny_proxy.url, "/paced?n=3&gap_ms=1")
    delete(tiny_proxy, "busy")
    put(tiny_proxy, "limited", abort={"status": 429, "retry_after": "2s", "probability": "100%"})
    limited = fetch(tiny_proxy.url, "/paced?n=3&gap_ms=1")
    stats = delete(tiny_proxy, "limited")["stats"]
    assert unavailable.status == 503 and "Retry-After" not in unavailable.headers
    assert limited.status == 429 and limited.headers["Retry-After"] == "2"
    assert limited.headers["X-Streamquake-Fault"] == "limited"
    assert stats["aborts_by_status"] == {"429": 1}
    assert tiny.hits == hits
    assert fetch(tiny_proxy.url, "/paced?n=3&gap_ms=1").ids() == [1, 2, 3]


@pytest.mark.timeout(30)
def test_reset_breaks_the_connection(proxy: ProxyProcess) -> None:
    put(proxy, "rst", reset={"after_events": 3})
    seen = fetch(proxy.url, "/v1/chat/completions", chat(50))
    stats = delete(proxy, "rst")["stats"]
    assert seen.status == 200
    assert isinstance(seen.error, ConnectionResetError), seen.error
    assert len(seen.ids()) <= 3
    assert stats["resets"] == 1


@pytest.mark.timeout(30)
def test_corrupt_makes_content_unparseable(proxy: ProxyProcess) -> None:
    put(proxy, "garble", corrupt="100%")
    seen = fetch(proxy.url, "/v1/chat/completions", chat(10))
    stats = delete(proxy, "garble")["stats"]
    data = seen.data()
    assert len(data) == 13 and data[-1] == b"[DONE]"
    for payload in data[1:11]:
        with pytest.raises(ValueError):
            json.loads(payload)
    assert json.loads(data[0]) and json.loads(data[11])  # control events are left alone
    assert stats["corruptions"] == 10 == stats["content_events"]


# --- control API and the injector --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_control_api(proxy: ProxyProcess) -> None:
    assert control(proxy, "DELETE", "/faults/never-set") == (
        200, {"name": "never-set", "removed": False, "fault": None, "stats": None})
    status, answer = control(proxy, "PUT", "/faults/bad", {"drop": "150%"})
    assert status == 400 and any(p.startswith("drop:") for p in answer["problems"]), answer
    put(proxy, "a", drop=0.1)
    assert put(proxy, "b", delay="5ms")["fault"] == {"delay_ms": 5.0, "delay_probability": 1.0}
    assert put(proxy, "b", delay="6ms")["replaced"] is True
    assert sorted(control(proxy, "GET", "/faults")[1]["faults"]) == ["a", "b"]
    fetch(proxy.url, "/v1/chat/completions", chat(5))
    stats = control(proxy, "GET", "/stats")[1]
    assert stats["faults"]["a"]["requests"] == stats["faults"]["b"]["requests"] == 1
    assert stats["totals"]["requests"] >= 1
    assert control(proxy, "GET", "/nope")[0] == 404


@pytest.mark.timeout(30)
def test_injector_applies_and_reverts_through_a_real_proxy(
    target: TargetProcess, tmp_path: Path
) -> None:
    spec = SSEProxyFault.model_validate(
        {"type": "sse_proxy", "name": "chunk-drop", "drop": "50%", "seed": 2}
    )
    journal = Journal(tmp_path / "journal.json")
    assert fault_type("sse_proxy").injector() is SSEProxyInjector
    with start_proxy(target.url) as p:
        ctx = RunContext("127.0.0.1", 0, tmp_path, resources=[FaultProxy.attached(p.control_url)])
        inj = SSEProxyInjector(spec, ctx)
        assert inj.preflight() == []
        assert inj.describe() == {"type": "sse_proxy", "name": "chunk-drop", "phase": "fault",
                                  "drop": 0.5, "seed": 2}
        entry = journal.add("sse_proxy", spec.label)
        applied = inj.apply(entry)
        state = journal.entries()[0]["state"]
        assert state == {"proxy_control_url": p.control_url, "name": "chunk-drop"}
        assert applied["fault"] == {"drop": 0.5, "seed": 2}
        seen = fetch(p.url, "/v1/chat/completions", chat(40))
        reverted = inj.revert()
        assert reverted["removed"] is True
        assert reverted["stats"]["events_dropped"] == 43 - len(seen.ids()) > 0
        after = fetch(p.url, "/v1/chat/completions", chat(40))
        assert after.ids() == list(range(1, 44))  # the fault is gone
        assert inj.revert()["removed"] is False  # idempotent
        assert "no longer active" in SSEProxyInjector.recover(state)
    # The proxy is gone: the fault died with it.
    assert "gone" in inj.revert()["note"]
    assert "ended with its proxy" in SSEProxyInjector.recover(state)
    assert "refuses connections" in inj.preflight()[0]
    with pytest.raises(InjectorError, match="gone"):
        inj.apply(journal.add("sse_proxy", spec.label))
    no_proxy = SSEProxyInjector(spec, RunContext("127.0.0.1", 0, tmp_path))
    assert "needs a streamquake SSE proxy to act in" in no_proxy.preflight()[0]
