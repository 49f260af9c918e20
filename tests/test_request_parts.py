"""``send_ms`` in parts (name resolution, TCP connect, TLS handshake, the write) and the W3C
``traceparent`` every request carries, against real servers on loopback: the test SSE server
(plain and TLS) and the embedded target, whose ``send_log`` records the trace id it received.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.errors import ScenarioError
from streamquake.loadgen import stamps
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.scenario import parse_scenario
from tests.test_client import plan_for, start_server
from tests.test_client import tls_server as tls_server  # noqa: F401  (a fixture, used below)

PARTS = ("dns_ms", "connect_ms", "tls_ms", "write_ms")
HOLD_S = 0.5
PHASES = "phases: {baseline: 1s, fault: 0s, recovery: 0s}\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(tmp_path_factory.mktemp("sse"))


def _twice(plan: LoadPlan) -> tuple[RequestSample, RequestSample]:
    """Two requests in a row on one client of one pooled socket: a new connection, then it
    again."""
    client = StreamClient(plan, environ={})
    try:
        first, second = (client.measure(RequestClassPlan(), random.Random(i)) for i in range(2))
    finally:
        client.close()
    for s in (first, second):
        assert s.error is None, s.error_detail
        assert s.send_ms is not None and s.write_ms is not None
        # The parts are disjoint stretches of send_ms: what is left is the pool's own work.
        assert sum(getattr(s, p) or 0.0 for p in PARTS) <= s.send_ms + 1e-6, s
    return first, second


def _no_connection_parts(s: RequestSample) -> bool:
    return s.reused and s.dns_ms is None and s.connect_ms is None and s.tls_ms is None


@pytest.mark.timeout(60)
def test_a_new_plain_connection_has_a_connect_a_reused_one_none(server: str) -> None:
    new, reused = _twice(plan_for(server, "/s?n=3"))
    assert not new.reused and new.connect_ms is not None and new.connect_ms > 0
    assert new.tls_ms is None            # plain HTTP
    assert new.dns_ms is None            # 127.0.0.1: no name to resolve
    assert _no_connection_parts(reused), reused


@pytest.mark.timeout(60)
def test_a_new_tls_connection_has_a_handshake(tls_server: tuple[str, Path]) -> None:  # noqa: F811
    url, _ = tls_server
    new, reused = _twice(plan_for(url, "/s?n=3", verify_tls=False))
    assert not new.reused and new.connect_ms is not None and new.connect_ms > 0
    assert new.tls_ms is not None and new.tls_ms > 0
    assert _no_connection_parts(reused), reused


@pytest.mark.timeout(60)
def test_a_host_name_is_resolved_an_address_is_not(server: str) -> None:
    by_name, _ = _twice(plan_for(server.replace("127.0.0.1", "localhost"), "/s?n=2"))
    by_address, _ = _twice(plan_for(server, "/s?n=2"))
    assert by_name.dns_ms is not None and by_name.dns_ms > 0
    assert by_address.dns_ms is None


@pytest.mark.timeout(60)
def test_a_held_write_shows_in_write_ms(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stamps, "_WRITE_HOLD_S", HOLD_S)
    new, reused = _twice(plan_for(server, "/s?n=2"))
    # The hold comes after the connection is ready: a sleep is never shorter than asked.
    for s in (new, reused):
        assert s.write_ms is not None and s.write_ms >= HOLD_S * 1000.0, s


@pytest.mark.timeout(30)
def test_the_parts_are_histograms_and_slo_metrics() -> None:
    samples = [RequestSample(cls="a", sent=0.0, send_ms=3.0, dns_ms=0.5, connect_ms=1.0,
                             tls_ms=1.0, write_ms=0.25),
               RequestSample(cls="a", sent=0.0, send_ms=0.5, write_ms=0.25, reused=True)]
    stats = Stats.from_samples(samples)
    assert [stats.count(p) for p in PARTS] == [1, 1, 1, 2]
    assert stats.summary("tls_ms")["p50"] == pytest.approx(1.0, rel=0.01)
    scenario = parse_scenario(
        "name: x\ntarget: {protocol: openai, embedded: {}}\n" + PHASES + "slos:\n"
        + "".join(f"  - {{metric: {p}, percentile: 95, max: 50}}\n" for p in PARTS))
    assert [s.metric for s in scenario.slos] == list(PARTS)
    plain = Stats.from_samples([samples[1]])
    assert (plain.unavailable("tls_ms") or "").startswith("not measurable")


@pytest.mark.timeout(60)
def test_every_request_carries_a_fresh_traceparent_that_reaches_the_target(
        tmp_path: Path) -> None:
    log = tmp_path / "send.jsonl"
    config = TargetConfig.model_validate(
        {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 3, "max": 3},
         "send_log": str(log)})
    with start_target(config) as target:
        client = StreamClient(LoadPlan(base_url=target.url, protocol="openai",
                                       samples_path="/nonexistent", end_at=0.0, timeout_s=10.0))
        try:
            samples = [client.measure(RequestClassPlan(max_tokens=3), random.Random(0))
                       for _ in range(4)]
        finally:
            client.close()
    ids = [s.trace_id for s in samples]
    assert all(s.error is None for s in samples), samples
    assert all(i is not None and re.fullmatch(r"[0-9a-f]{32}", i) and i != "0" * 32
               for i in ids), ids
    assert len(set(ids)) == 4, ids                  # one per request, however alike they are
    # The target read them off the requests: each response id joins its trace id.
    logged = {(r["id"], r["trace_id"])
              for r in map(json.loads, log.read_text().splitlines())}
    assert logged == {(s.response_id, s.trace_id) for s in samples}


@pytest.mark.timeout(30)
def test_a_scenario_cannot_set_its_own_traceparent() -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario("name: x\ntarget: {protocol: openai, embedded: {}, headers: {TraceParent: "
                       "'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'}}\n"
                       + PHASES)
    assert "'traceparent' is streamquake's own" in str(info.value)
