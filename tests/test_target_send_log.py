"""``send_log``: the target appends one JSON line per stream (its response id, when the request
arrived, and the send time of every write, content or not), read here after real requests to a
real target process; off by default."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.loadgen.sse_parser import SSEParser
from tests.helpers import read_send_log
from tests.test_target_stamps import REQUESTS, STAMP, dechunk

TOKENS = 12
CONFIG = {"ttft": "20ms", "itl": "5ms", "output_tokens": {"min": TOKENS, "max": TOKENS},
          "seed": 5}



def _request(url: str, path: str, body: dict[str, object]) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    return head + payload


def fetch(url: str, path: str, body: dict[str, object]) -> bytes:
    """The whole HTTP response (chunked framing left in: the events' bytes are whole in it)."""
    raw = bytearray()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(_request(url, path, body))
        while chunk := sock.recv(65536):
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 200"), bytes(raw[:200])
    return bytes(raw)


def streamed_ids(protocol: str, body: bytes) -> set[str]:
    """Every response id the stream's events carry, as a client reads them."""
    ids: set[str] = set()
    for ev in SSEParser().feed(body):
        if not ev.data.startswith("{"):
            continue            # OpenAI's [DONE]
        data: dict[str, Any] = json.loads(ev.data)
        if protocol == "openai":
            ids.add(data["id"])
        elif protocol == "anthropic" and data["type"] == "message_start":
            ids.add(data["message"]["id"])
        elif protocol == "gemini":
            ids.add(data["responseId"])
    return ids


@pytest.mark.timeout(60)
def test_one_line_per_stream_with_its_id_and_every_write_in_order(tmp_path: Path) -> None:
    log = tmp_path / "send.jsonl"
    cfg = TargetConfig.model_validate({**CONFIG, "send_log": str(log), "stamp_send_time": True})
    bodies: dict[str, bytes] = {}
    before = time.time_ns()
    with start_target(cfg) as target:
        for protocol, (path, body) in REQUESTS.items():
            bodies[protocol] = fetch(target.url, path, body)
    after = time.time_ns()    # the target has stopped: its buffered lines are written
    lines = read_send_log(log)
    assert len(lines) == len(REQUESTS)
    by_protocol = {line["protocol"]: line for line in lines}
    assert set(by_protocol) == set(REQUESTS)
    for protocol, line in by_protocol.items():
        sent, content = line["sent_ns"], line["content"]
        assert len(sent) == len(content)
        assert sum(content) == TOKENS                       # one write per token asked
        assert set(content) == {0, 1}                       # and the closing one at least
        assert content[-1] == 0
        assert before <= line["arrived_ns"] <= line["admitted_ns"] <= sent[0] <= after
        assert sent == sorted(sent)
        tokens = [t for t, c in zip(sent, content, strict=True) if c]
        assert all(b > a for a, b in zip(tokens, tokens[1:], strict=False))
        # The tokens are due a TTFT, then an ITL each, after admission, and never sent early.
        assert tokens[0] - line["admitted_ns"] >= 19_000_000
        assert tokens[-1] - line["admitted_ns"] >= 20_000_000 + (TOKENS - 1) * 5_000_000 - 1_000_000
        assert line["complete"] is True
        raw = bodies[protocol]
        # The same send times the stamp comments carry, write for write.
        stamps = sorted({int(m) for m in STAMP.findall(raw)})
        assert stamps == sorted(set(sent))
        if protocol == "sse":
            assert line["id"] is None                       # the generic format has no id
        else:
            assert streamed_ids(protocol, dechunk(raw[raw.index(b"\r\n\r\n") + 4:])) == {line["id"]}
            assert line["id"].startswith({"openai": "chatcmpl-", "anthropic": "msg_",
                                          "gemini": ""}[protocol])


@pytest.mark.timeout(60)
def test_a_stream_the_client_leaves_is_logged_as_incomplete(tmp_path: Path) -> None:
    log = tmp_path / "send.jsonl"
    cfg = TargetConfig.model_validate({**CONFIG, "itl": "50ms", "send_log": str(log)})
    with start_target(cfg) as target:
        path, body = REQUESTS["openai"]
        host, port = target.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(_request(target.url, path, body))
            seen = b""
            while seen.count(b"chatcmpl-") < 3:     # the first tokens are out
                chunk = sock.recv(65536)
                assert chunk, seen
                seen += chunk
        # Stopping the target ends the handler if the hang-up has not yet: logged either way.
    (line,) = read_send_log(log)
    assert line["complete"] is False
    assert 1 <= sum(line["content"]) < TOKENS
    assert line["id"].startswith("chatcmpl-")


def test_off_by_default_and_round_trips() -> None:
    assert TargetConfig().send_log is None
    cfg = TargetConfig.model_validate({"send_log": "/tmp/x.jsonl"})
    assert TargetConfig.model_validate_json(cfg.model_dump_json(by_alias=True)).send_log == (
        "/tmp/x.jsonl")


def test_a_log_that_cannot_be_opened_stops_the_target_with_a_reason(tmp_path: Path) -> None:
    from streamquake.errors import TargetError

    cfg = TargetConfig.model_validate({"send_log": str(tmp_path / "no" / "such" / "dir.jsonl")})
    with pytest.raises(TargetError, match="cannot open the send log"):
        start_target(cfg).stop()
