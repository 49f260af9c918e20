"""A request is dated when its last byte is written: TTFB, TTFT and E2E count from there, and
the time before it (a free connection, a connect, the write) is its own figure, ``send_ms``.

A test-only hook (``stamps._WRITE_HOLD_S``, set in a load process by
``$STREAMQUAKE_TEST_WRITE_HOLD_MS``) holds every write back before it starts, as a client
late to write would. Against a real server process on 127.0.0.1, plain and TLS.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.loadgen import stamps
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.protocols import Protocol
from tests.test_client import measure, plan_for, start_server
from tests.test_secrets import canaries, measure_echo

HOLD_S = 1.0
FIRST_MS = 20       # the server's own wait before its first event


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(tmp_path_factory.mktemp("sse"))


@pytest.mark.timeout(60)
def test_a_held_write_shows_in_send_ms_not_in_ttfb_or_ttft(
        server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_for(server, f"/s?n=5&first_ms={FIRST_MS}&gap_ms=5")
    plain = measure(plan)
    monkeypatch.setattr(stamps, "_WRITE_HOLD_S", HOLD_S)
    held = measure(plan)
    for s in (plain, held):
        assert s.error is None, s
        assert s.send_ms is not None and s.ttfb_ms is not None and s.ttft_ms is not None
        assert s.e2e_ms is not None
    # A sleep is never shorter than asked: the hold is all in send_ms ...
    assert held.send_ms is not None and held.send_ms >= HOLD_S * 1000.0
    assert held.started + held.send_ms / 1000.0 == pytest.approx(held.sent)
    # ... and none of it in TTFB, TTFT or E2E: had they counted from the attempt's start, each
    # would be at least HOLD_S + FIRST_MS.
    for ms in (held.ttfb_ms, held.ttft_ms, held.e2e_ms):
        assert ms is not None and ms < HOLD_S * 1000.0, held


@pytest.mark.timeout(60)
def test_a_request_never_written_has_no_send_time(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:        # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sample = measure(plan_for(f"http://127.0.0.1:{port}", "/s"))
    assert sample.error == "connect"
    assert sample.send_ms is None and sample.started == sample.sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("protocol", "shape"), [
    ("openai", r"chatcmpl-[0-9a-f]{24}"), ("anthropic", r"msg_[0-9a-f]{24}"),
    ("gemini", r"\S{8,}")])
def test_each_sample_keeps_the_response_id_its_server_gave(protocol: Protocol, shape: str) -> None:
    config = TargetConfig.model_validate(
        {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 4, "max": 4}})
    with start_target(config) as target:
        client = StreamClient(LoadPlan(base_url=target.url, protocol=protocol,
                                       samples_path="/nonexistent", end_at=0.0, timeout_s=10.0))
        try:
            ids = [client.measure(RequestClassPlan(max_tokens=4), random.Random(i)).response_id
                   for i in range(3)]
        finally:
            client.close()
    assert all(i is not None and re.fullmatch(shape, i) for i in ids), ids
    assert len(set(ids)) == 3, ids       # one id per response: a key into the server's logs


@pytest.mark.timeout(30)
def test_a_response_id_that_echoes_the_key_is_redacted_then_cut(echo_server: str) -> None:
    # The key sits 110 characters into the id, across the cut: redacting after cutting would
    # keep part of it.
    env = canaries()
    sample = measure_echo(echo_server, "/echo-key-id", env)
    assert sample.error is None, sample.error_detail
    assert sample.response_id is not None and sample.response_id.startswith("r" * 100)
    line = sample.to_json()
    for value in env.values():
        assert not any(value[i:i + 8] in line for i in range(len(value) - 7)), line
