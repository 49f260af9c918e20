"""Read batching (streamquake/loadgen/batching.py): while a load process is busy, its gevent loop
polls its sockets at most once per interval. Against the real SSE server of test_client.py on
127.0.0.1 and this process's own libev loop: batched, the shared reader reads many sockets a
round instead of one or two, and every event is still dated by its kernel stamp, when it
arrived, not when the loop got to it; the guard engages it on a busy second, lets it go on a
quiet one or on a read without a kernel stamp, and says so in its line."""

from __future__ import annotations

import io
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import gevent
import pytest

from streamquake.loadgen import batching, self_measure
from streamquake.loadgen import reader as shared_reader
from streamquake.loadgen.batching import COLLECT_S, Batching, loop_setter
from tests.conftest import REPO, run_cli
from tests.test_client import start_server
from tests.test_shared_reader import run_streams

GAP_MS = 40         # the server's gap between a stream's events
STREAMS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(tmp_path_factory.mktemp("sse"))


def _read(server: str, batch: Batching | None) -> tuple[float, list[float]]:
    """STREAMS streams of 12 events GAP_MS apart, all at once: the reads per round of the
    shared reader, and every inter-token gap the streams dated."""
    r = shared_reader.reader()
    assert r is not None
    rounds, reads = r.rounds, r.reads
    try:
        samples = run_streams(server, [f"/s?n=12&gap_ms={GAP_MS}"] * STREAMS)
    finally:
        if batch is not None:
            batch.close()
    assert [s.error for s in samples] == [None] * STREAMS
    assert {s.content_events for s in samples} == {12}
    return (r.reads - reads) / max(1, r.rounds - rounds), [g for s in samples for g in s.itl_ms]


def _p75_off(gaps: list[float], center: float) -> float:
    """How far from ``center`` three quarters of the gaps are, at most (ms)."""
    off = sorted(abs(g - center) for g in gaps)
    return off[len(off) * 3 // 4]


@pytest.mark.timeout(90)
def test_batched_reads_come_many_a_round_and_keep_their_kernel_times(server: str) -> None:
    setter = loop_setter(gevent.get_hub().loop)
    assert setter is not None, "gevent's default loop here is libev's: the interval can be set"
    at_once, gaps_at_once = _read(server, None)
    # 20 ms: far longer than in use (0.5 ms), so that what it does cannot hide in this
    # machine's noise; still half the server's gap, so no two events of one stream are read
    # together.
    batched, gaps_batched = _read(server, Batching(setter, mode="20"))
    typical = statistics.median(gaps_at_once)
    spread, spread_batched = _p75_off(gaps_at_once, typical), _p75_off(gaps_batched, typical)
    print(f"\nreads a round: {at_once:.2f} at once, {batched:.2f} batched; ITL median "
          f"{typical:.2f} / {statistics.median(gaps_batched):.2f} ms, three quarters within "
          f"{spread:.2f} / {spread_batched:.2f} ms of it")
    # 20 streams, an event each 40 ms: 500 reads/s, ~10 due in 20 ms. Read at once, one or two
    # sockets are ready when the loop wakes (more only on a machine too busy to wake it soon).
    assert batched >= 3 * at_once, (batched, at_once)
    # The reads came up to 20 ms late, but an event's time is the kernel's receive stamp: the
    # gaps are the server's 40 ms (and its own lateness) as they are when read at once. Dated
    # when read, they would spread over 20-60 ms.
    assert abs(typical - GAP_MS) < 5.0, typical
    assert abs(statistics.median(gaps_batched) - typical) < 1.5, statistics.median(gaps_batched)
    assert spread_batched < spread + 3.0, (spread_batched, spread)


def test_the_guard_engages_it_when_busy_and_lets_it_go_when_quiet_or_user_timed() -> None:
    """The rule itself, over a setter that keeps what it was told (libev cannot be asked)."""
    told: list[float] = []
    auto = Batching(told.append, mode="auto")
    assert auto.update(cpu_pct=40.0, user_reads=0) == 0.0          # not busy enough to engage
    assert auto.update(cpu_pct=60.0, user_reads=0) == COLLECT_S
    assert auto.update(cpu_pct=40.0, user_reads=0) == COLLECT_S    # between the two: kept
    assert auto.update(cpu_pct=30.0, user_reads=0) == 0.0          # quiet: let go
    assert auto.update(cpu_pct=95.0, user_reads=0) == COLLECT_S
    assert auto.update(cpu_pct=95.0, user_reads=3) == 0.0          # a read our clock timed
    assert auto.update(cpu_pct=95.0, user_reads=0) == COLLECT_S
    auto.close()
    assert told == [COLLECT_S, 0.0, COLLECT_S, 0.0, COLLECT_S, 0.0]
    off: list[float] = []
    never = Batching(off.append, mode="off")
    assert never.update(cpu_pct=100.0, user_reads=0) == 0.0 and off == []
    on: list[float] = []
    always = Batching(on.append, mode="on")
    assert always.update(cpu_pct=1.0, user_reads=5) == COLLECT_S and on == [COLLECT_S]
    assert Batching(on.append, mode="2.5").interval_s == 0.0025
    # Where the loop cannot be told (not libev's), nothing is, and it says so.
    assert not Batching(None, mode="on").available
    assert Batching(None, mode="on").update(cpu_pct=100.0, user_reads=0) == 0.0


@pytest.mark.parametrize("value", ["sometimes", "0", "-1", "nan", "600"])
def test_a_wrong_setting_is_refused_with_what_it_takes(value: str) -> None:
    with pytest.raises(ValueError, match=f"{batching.ENV}=.*auto, off, on"):
        Batching(None, mode=value)


@pytest.mark.timeout(30)
def test_the_guards_line_says_the_interval_in_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(batching.ENV, "on")
    sink = io.StringIO()
    sink.close = lambda: None     # type: ignore[method-assign]  # read after stop()
    guard = self_measure.start(None, sink=sink)
    assert guard is not None
    try:
        deadline = time.monotonic() + 10
        while sink.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            gevent.sleep(0.1)
    finally:
        self_measure.stop()
    lines = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert len(lines) >= 2, lines
    assert {line["read_batch_ms"] for line in lines} == {COLLECT_S * 1000.0}


@pytest.mark.timeout(60)
def test_streamquake_run_refuses_a_wrong_setting_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli("run", str(REPO / "scenarios" / "quickstart.yaml"), "--out", str(out),
                   env={batching.ENV: "sometimes"})
    assert done.returncode != 0, done.stdout[-2000:]
    said = done.stdout + done.stderr
    assert f"{batching.ENV}='sometimes': expected one of auto, off, on" in said, said[-2000:]
    assert "no load was sent" in said or not (out / "run" / "load-plan.json").exists(), said


@pytest.mark.timeout(30)
def test_the_guard_decides_each_second_from_the_one_before(tmp_path: Path) -> None:
    """Auto, in this process: idle, then busy (a spin that lets the hub run each ms). Each
    second's line carries the interval the rule chose from the line before it, the rule fed
    with what that line says (CPU, reads without a kernel stamp)."""
    guard = self_measure.start(None, tmp_path)
    assert guard is not None
    try:
        gevent.sleep(1.1)
        end = time.perf_counter() + 3.2
        while time.perf_counter() < end:
            until = time.perf_counter() + 0.001
            while time.perf_counter() < until:
                pass
            gevent.sleep(0)
        gevent.sleep(0.1)
    finally:
        self_measure.stop()
    (path,) = tmp_path.glob(f"{self_measure.FILE_PREFIX}*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) >= 4, lines
    rule = Batching(lambda s: None, mode="auto")
    expected = [0.0]
    for line in lines[:-1]:
        expected.append(rule.update(line["cpu_pct"], line["user_reads"]) * 1000.0)
    print("\n" + ", ".join(f"{line['cpu_pct']}% -> {line['read_batch_ms']}" for line in lines))
    assert [line["read_batch_ms"] for line in lines] == expected
    # The spin's seconds used most of a core unless this machine kept it from one.
    assert any(line["read_batch_ms"] > 0 for line in lines) or \
        max(line["cpu_pct"] for line in lines) < batching.ENGAGE_CPU_PCT, lines
