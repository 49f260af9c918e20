"""One reader for every plain-TCP stream of a load process (streamquake/loadgen/reader.py),
against the real SSE server of test_client.py on 127.0.0.1: the streams in flight share one
epoll set read in the hub; each stream's greenlet waits for its end. What it must keep: the same
events as a greenlet reading its own socket, one stream's failure its own, and no socket left in
the set however a stream ends (finished, failed, timed out, its greenlet killed).
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import gevent
import pytest
from gevent.monkey import get_original

from streamquake.loadgen import reader as shared_reader
from streamquake.loadgen import speedups
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from tests.test_client import plan_for, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(tmp_path_factory.mktemp("sse"))


@pytest.fixture(autouse=True, params=["compiled", "python"])
def round_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with the reader's round in C (``speedups.read_round``) and in Python
    (``Reader._read_round``): the same reads, ends and failures."""
    if request.param == "python":
        monkeypatch.setattr(shared_reader, "_read_round", None)
    elif speedups.read_round is None:
        pytest.skip("the compiled part is not built")
    return str(request.param)


def in_set() -> int:
    """Sockets in the reader's epoll set, as the kernel lists them (/proc fdinfo)."""
    r = shared_reader.reader()
    assert r is not None
    info = Path(f"/proc/self/fdinfo/{r._epoll.fileno()}").read_text()
    return sum(line.startswith("tfd:") for line in info.splitlines())


def run_streams(base_url: str, paths: list[str], timeout_s: float = 10.0) -> list[RequestSample]:
    """One stream per path, all at once, each from its own client (its own connection)."""
    def one(path: str) -> RequestSample:
        client = StreamClient(plan_for(base_url, path, timeout_s=timeout_s))
        try:
            return client.measure(RequestClassPlan(), random.Random(0))
        finally:
            client.close()
    jobs = [gevent.spawn(one, p) for p in paths]
    # The bound is a gevent.Timeout, not joinall's ``timeout``: joinall arms its timer on the
    # loop's cached clock, which stands still while the worker's main greenlet runs without the
    # hub (other tests before this one, for minutes): its timer then fires at once, and
    # streams a few milliseconds old looked "stuck 30 s" (three CI runs; 0.4 ms for a
    # ``timeout=3`` after a 4 s block, where a gevent.Timeout, which updates the clock first,
    # fired at 3.0 s). The streams' own deadlines are gevent.Timeouts too
    # (test_a_stream_begun_after_the_hub_was_held_gets_its_whole_timeout).
    with gevent.Timeout(timeout_s + 20, False):
        gevent.joinall(jobs, raise_error=True)
    # Each stream ends within its timeout: one still running 20 s past it is a hang, to be
    # shown where it stands.
    stuck = {path: "".join(traceback.format_stack(j.gr_frame)) if j.gr_frame else "(no frame)"
             for path, j in zip(paths, jobs, strict=True) if not j.ready()}
    if stuck:
        r = shared_reader.reader()
        state = None if r is None else dict(
            following=len(r._steps), backlogged=len(r._backlogged), rounds=r.rounds,
            reads=r.reads, watcher_active=r._watcher.active, idle_active=r._idle.active)
        gevent.killall(jobs, timeout=5)
        pytest.fail(f"{len(stuck)} of {len(paths)} streams still running {timeout_s + 20:g} s "
                    f"after they began; the reader: {state}; where they were:\n"
                    + "\n".join(f"{path}:\n{stack}" for path, stack in stuck.items()))
    return [j.value for j in jobs]


def essence(s: RequestSample) -> tuple[object, ...]:
    """What a stream's events say, whoever read them (not when they came, nor how many bytes
    or which clock: those follow how the server's writes fell into reads, run by run)."""
    return (s.error, s.error_detail, s.content_events, s.expected_events, s.missing_events,
            s.usage_tokens, s.output_tokens, s.finish_reason, len(s.itl_ms))


@pytest.mark.timeout(60)
def test_many_streams_are_read_by_the_one_reader_and_leave_its_set_empty(server: str) -> None:
    r = shared_reader.reader()
    assert r is not None
    reads = r.reads
    samples = run_streams(server, [f"/s?n=20&gap_ms={5 + i % 7}" for i in range(30)])
    assert [s.error for s in samples] == [None] * 30
    assert {s.content_events for s in samples} == {20}
    # Kernel-stamped: every stream that read content after its headers (on a busy machine a
    # whole short stream may come with them, timed at the headers as TTFB is).
    assert {s.clock for s in samples if s.content_reads > 1} == {"kernel"}
    # Every read that brought a stream's content came through the shared set, but for the
    # one that came with the response headers (read by the greenlet, before it waits).
    content_reads = sum(s.content_reads for s in samples)
    assert content_reads >= 30 * 5       # 5-11 ms apart: mostly an event a read, if not busy
    assert r.reads - reads >= content_reads - len(samples)
    assert not r._steps and in_set() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eol", ["lf", "crlf"])
def test_the_shared_reader_and_own_reads_see_the_same_events(
        server: str, eol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [f"/s?n=25&gap_ms=3&eol={eol}", f"/s?n=12&skip=4,7&eol={eol}",
             f"/s?n=8&gap_ms=2&stall=5:400&eol={eol}", f"/s?n=6&gap_ms=30&garbage=3&eol={eol}"]
    shared = run_streams(server, paths)
    monkeypatch.setattr(shared_reader, "SHARED", False)
    assert shared_reader.reader() is None
    own = run_streams(server, paths)
    assert [essence(s) for s in shared] == [essence(s) for s in own]
    assert [s.error for s in shared] == [None, None, None, "protocol"]
    assert (shared[1].expected_events, shared[1].missing_events) == (13, 2)
    assert shared[2].stalls == own[2].stalls == 1


@pytest.mark.timeout(60)
def test_one_streams_failure_in_the_reader_is_its_own(server: str) -> None:
    paths = ["/s?n=30&gap_ms=10&garbage=5", "/s?n=30&gap_ms=10&error=8",
             "/s?n=30&gap_ms=10&cut=12"] + ["/s?n=30&gap_ms=10"] * 5
    samples = run_streams(server, paths)
    assert [s.error for s in samples] == ["protocol", "stream_error", "truncated"] + [None] * 5
    assert [s.content_events for s in samples[3:]] == [30] * 5
    assert in_set() == 0


@pytest.mark.timeout(60)
def test_a_stream_timed_out_or_killed_mid_answer_leaves_the_set(server: str) -> None:
    r = shared_reader.reader()
    assert r is not None
    # Timed out: its server goes silent after 2 events, past the 1 s bound.
    silent = run_streams(server, ["/s?n=5&gap_ms=5&stall=3:5000"], timeout_s=1.0)[0]
    assert silent.error == "timeout" and silent.content_events == 2
    assert in_set() == 0
    # Killed (Locust stopping a user): its greenlet gets GreenletExit while the reader holds
    # its socket; the socket leaves the set, and the other stream goes on to its end.
    client = StreamClient(plan_for(server, "/s?n=400&gap_ms=20"))
    other = StreamClient(plan_for(server, "/s?n=150&gap_ms=20"))
    try:
        doomed = gevent.spawn(client.measure, RequestClassPlan(), random.Random(0))
        survivor = gevent.spawn(other.measure, RequestClassPlan(), random.Random(0))
        with gevent.Timeout(5):         # both streaming (a busy machine takes longer)
            while in_set() < 2:
                gevent.sleep(0.01)
        assert len(r._steps) == 2
        doomed.kill(block=True, timeout=5)
        assert doomed.dead and in_set() == 1
        survivor.join(timeout=15)
        assert survivor.value is not None and survivor.value.error is None
        assert survivor.value.content_events == 150
    finally:
        client.close()
        other.close()
    assert not r._steps and in_set() == 0


@pytest.mark.timeout(60)
def test_a_stream_begun_after_the_hub_was_held_gets_its_whole_timeout(server: str) -> None:
    # The loop's clock stands still while nothing runs the hub (here the test's own greenlet
    # sleeping in the C library; in a load process, a long hold). A deadline armed on that
    # clock would end a stream early, by as long as the hold: a 0.75 s stream with a 2.5 s
    # timeout, begun after a 3 s hold, would be a "timeout" at once.
    client = StreamClient(plan_for(server, "/s?n=4&gap_ms=250", timeout_s=2.5))
    try:
        get_original("time", "sleep")(3.0)
        begun = time.perf_counter()
        sample = client.measure(RequestClassPlan(), random.Random(0))
        took = time.perf_counter() - begun
    finally:
        client.close()
    assert (sample.error, sample.content_events) == (None, 4), (sample.error_detail, took)
    assert took >= 0.75
