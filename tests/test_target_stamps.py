"""``stamp_send_time``: the target writes each event's send time into an SSE comment, read here
off a real socket from a real target process; off by default."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.loadgen.sse_parser import SSEEvent, SSEParser

CONFIG = {"ttft": "20ms", "itl": "10ms", "output_tokens": {"min": 12, "max": 12}, "seed": 3}
TTFT_NS, ITL_NS = 20_000_000, 10_000_000
# Send -> receive on loopback is microseconds; the margin is for a busy 2-core CI machine.
MARGIN_NS = 250_000_000
STAMP = re.compile(rb"^: t=(\d+)\r?$", re.M)

REQUESTS: dict[str, tuple[str, dict[str, object]]] = {
    "openai": ("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}}),
    "anthropic": ("/v1/messages", {
        "model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}],
        "stream": True}),
    "gemini": ("/v1beta/models/g:streamGenerateContent?alt=sse",
               {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
    "sse": ("/v1/stream", {"prompt": "hi"}),
}


@dataclass
class Wire:
    body: bytes                      # the HTTP body, de-chunked
    stamps: list[tuple[int, int]]    # (stamped send ns, receive ns of the read that brought it)


def dechunk(raw: bytes) -> bytes:
    """An HTTP/1.1 chunked body, de-chunked."""
    out, pos = bytearray(), 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += raw[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def fetch(url: str, path: str, body: dict[str, object]) -> Wire:
    """POST over a plain socket; every read is timestamped with time.time_ns() as it returns."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    raw, reads = bytearray(), []     # reads: (end offset in raw, receive ns)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + payload)
        while chunk := sock.recv(65536):
            raw += chunk
            reads.append((len(raw), time.time_ns()))
    header_end = raw.index(b"\r\n\r\n") + 4
    assert raw.startswith(b"HTTP/1.1 200"), bytes(raw[:200])
    assert b"chunked" in raw[:header_end].lower()
    stamps = []
    for m in STAMP.finditer(raw, header_end):
        received = next(t for end, t in reads if end >= m.end())
        stamps.append((int(m.group(1)), received))
    return Wire(dechunk(bytes(raw[header_end:])), stamps)


def events(body: bytes) -> list[SSEEvent]:
    parser = SSEParser()
    return parser.feed(body)


@pytest.fixture
def stamping() -> Iterator[TargetProcess]:
    with start_target(TargetConfig.model_validate({**CONFIG, "stamp_send_time": True})) as t:
        yield t


@pytest.fixture
def plain() -> Iterator[TargetProcess]:
    with start_target(TargetConfig.model_validate(CONFIG)) as t:
        yield t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", list(REQUESTS))
def test_every_event_carries_its_send_time_monotone_and_near_its_receipt(
    stamping: TargetProcess, protocol: str
) -> None:
    path, body = REQUESTS[protocol]
    before = time.time_ns()
    wire = fetch(stamping.url, path, body)
    evs = events(wire.body)
    # One comment per event, opening it: the raw blocks between blank lines each start with one.
    eol = b"\r\n" if protocol == "gemini" else b"\n"
    blocks = [b for b in wire.body.split(eol + eol) if b]
    assert len(blocks) == len(evs) == len(wire.stamps)
    assert all(STAMP.match(b) for b in blocks)
    sent = [s for s, _ in wire.stamps]
    assert sent == sorted(sent)
    assert before <= sent[0]
    for s, received in wire.stamps:
        assert 0 <= received - s < MARGIN_NS, (received - s) / 1e6
    # Events written together share a stamp. The 12 token writes come just before the closing
    # one, on deadlines TTFT + k * ITL after admission: never early, and a late one shortens
    # the next gap rather than shifting the rest.
    writes = sorted(set(sent))
    tokens = writes[-13:-1]
    assert len(writes) in (13, 14)
    assert tokens[-1] - before >= TTFT_NS + 11 * ITL_NS
    assert tokens[-1] - tokens[0] < 11 * ITL_NS + MARGIN_NS


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", list(REQUESTS))
def test_stamps_are_invisible_to_an_sse_parser_and_absent_by_default(
    stamping: TargetProcess, plain: TargetProcess, protocol: str
) -> None:
    path, body = REQUESTS[protocol]
    stamped, default = fetch(stamping.url, path, body), fetch(plain.url, path, body)
    assert default.stamps == []
    assert b": t=" not in default.body and b"\0" not in stamped.body
    for line in default.body.splitlines():
        assert line == b"" or line.startswith((b"data: ", b"event: ")), line
    # Same seed, same request number: the same events once the comments are skipped (the
    # response ids and creation times are drawn per response, so they are masked).
    mask = re.compile(r'"(id|responseId|created)":("[^"]*"|\d+)')

    def seen(wire: Wire) -> list[tuple[str, str]]:
        return [(e.event, mask.sub("", e.data)) for e in events(wire.body)]

    assert seen(stamped) == seen(default)
    assert len(seen(default)) >= 12


@pytest.mark.timeout(60)
def test_the_openai_and_anthropic_sdks_skip_the_stamps(stamping: TargetProcess) -> None:
    from anthropic import Anthropic
    from openai import OpenAI

    with OpenAI(base_url=stamping.url + "/v1", api_key="x", max_retries=0, timeout=10) as oa:
        chunks = oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    with Anthropic(base_url=stamping.url, api_key="x", max_retries=0, timeout=10) as an:  # noqa: SIM117
        with an.messages.stream(model="m", max_tokens=100,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join(stream.text_stream)
    assert len(text.split()) == 12


def test_the_option_is_off_by_default_and_round_trips() -> None:
    assert TargetConfig().stamp_send_time is False
    cfg = TargetConfig.model_validate({"stamp_send_time": True})
    assert TargetConfig.model_validate_json(cfg.model_dump_json(by_alias=True)).stamp_send_time
