"""The compiled part (streamquake/loadgen/_speedups.c, issue 36) against the Python it stands
in for: the same histogram counts for any values; the same read and arrival times off a real
TCP socket on 127.0.0.1; chunked bodies decoded as geventhttpclient's parser (llhttp) decodes
them, however cut into reads, broken or not; the same events of whole streams from a real
server; a connection reused after it. The compiled part must be built where the tests run:
``scripts/setup`` builds it, and a machine where it silently did not would leave the product
on the slower path with nothing said."""

from __future__ import annotations

import math
import os
import random
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from geventhttpclient.response import HTTPParseError, HTTPResponse
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamquake.loadgen import client, histogram, speedups, stamps
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.histogram import HIGHEST, _count_ms_py, _index_constants
from streamquake.loadgen.plan import RequestClassPlan
from tests.test_client import plan_for
from tests.test_shared_reader import essence, run_streams
from tests.test_shared_reader import server as server  # noqa: F401 - the module's fixture

needs_compiled = pytest.mark.skipif(
    os.environ.get("STREAMQUAKE_SPEEDUPS") == "0", reason="STREAMQUAKE_SPEEDUPS=0 asked for Python")


@needs_compiled
def test_the_compiled_part_is_built_and_runs() -> None:
    assert speedups.compiled is not None, speedups.describe()
    assert speedups.describe().startswith("compiled")
    assert histogram._count_ms is speedups.count_ms is speedups.compiled.count_ms
    assert stamps._recv_stamped is speedups.recv_stamped is speedups.compiled.recv_stamped


_ms = st.one_of(
    st.floats(min_value=-1e3, max_value=5e6, allow_nan=False),
    # ties: what scales to k + 0.5 microseconds (Python's round() goes to the even one)
    st.integers(min_value=0, max_value=10**7).map(lambda k: (k + 0.5) / 1000.0),
    st.integers(min_value=-5, max_value=HIGHEST // 1000 + 5),
    st.sampled_from([0.0, -0.0, 1e-9, 0.0005, 0.0015, 0.0025, HIGHEST / 1000.0,
                     HIGHEST / 1000.0 + 0.0005, 1e300, -1e300]),
)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(values=st.lists(_ms, max_size=60), sig_figs=st.sampled_from([2, 3, 4]),
       base=st.sampled_from([0, 7 << 16]), before=st.dictionaries(
           st.integers(min_value=0, max_value=1 << 20), st.integers(min_value=1, max_value=9),
           max_size=5))
@example(values=[0.0005, 0.0015, 0.0025, 0.0035], sig_figs=4, base=0, before={})
def test_counting_gaps_compiled_equals_python(values: list[float], sig_figs: int, base: int,
                                              before: dict[int, int]) -> None:
    assert speedups.compiled is not None
    constants = _index_constants(sig_figs)
    python, compiled = dict(before), dict(before)
    n_py = _count_ms_py(python, values, *constants, base)
    n_c = speedups.compiled.count_ms(compiled, values, *constants, base)
    assert compiled == python
    assert n_c == n_py == len(values)


@needs_compiled
@pytest.mark.parametrize("n", [64, 65, 128, 129, 2000])
def test_counting_many_gaps_compiled_equals_python(n: int) -> None:
    # Past 64 keys the compiled count sorts with qsort, past 128 into memory of its own; a
    # steady pace and zero gaps repeat buckets, so runs longer than one are counted too.
    assert speedups.compiled is not None
    rng = random.Random(n)
    values = [rng.choice([0.0, 20.0, rng.uniform(15, 40), rng.uniform(0, 5e3)])
              for _ in range(n)]
    for sig_figs, base in ((4, 0), (2, 3 << 16)):
        constants = _index_constants(sig_figs)
        python, compiled = {9: 2}, {9: 2}
        assert speedups.compiled.count_ms(compiled, values, *constants, base) == n
        _count_ms_py(python, values, *constants, base)
        assert compiled == python
        assert sum(compiled.values()) == n + 2


@needs_compiled
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_counting_a_value_python_cannot_round_fails_as_python_does(bad: float) -> None:
    assert speedups.compiled is not None
    constants = _index_constants(4)
    with pytest.raises((ValueError, OverflowError)) as python:
        _count_ms_py({}, [1.0, bad], *constants, 0)
    table: dict[int, int] = {}
    with pytest.raises((ValueError, OverflowError)) as compiled:
        speedups.compiled.count_ms(table, [1.0, bad], *constants, 0)
    assert type(compiled.value) is type(python.value)
    assert table == {}          # every key is made before the table is touched


@pytest.fixture(scope="module", autouse=True)
def kernel_stamps_on() -> Iterator[None]:
    """The kernel stamps received packets only while some socket asks it to, and it starts
    doing so a moment after the first one asks (Linux enables its timestamp key from a work
    queue): a socket that asks here, kept open for the module, and a stamp seen before the
    tests, so that none of them races that start (it read "user" clocks once in six runs)."""
    tx, rx = _connected()
    try:
        assert stamps.enable_kernel_timestamps(rx)
        arrival = stamps.Arrival(rx, time.perf_counter())
        deadline = time.monotonic() + 5
        while True:
            tx.sendall(b"x")
            rx.settimeout(5)
            arrival.recv(rx, 1)
            if arrival.kernel:
                break
            assert time.monotonic() < deadline, "the kernel never stamped a read"
            time.sleep(0.01)
        yield
    finally:
        tx.close()
        rx.close()


def _connected() -> tuple[socket.socket, socket.socket]:
    """A TCP connection on 127.0.0.1: (sender, receiver)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    tx = socket.create_connection(srv.getsockname(), timeout=5)
    rx, _ = srv.accept()
    srv.close()
    return tx, rx


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair on 127.0.0.1: (sender, receiver), the receiver non-blocking."""
    tx, rx = _connected()
    rx.setblocking(False)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


def _read(arrival: stamps.Arrival, rx: socket.socket, ready: bool) -> bytes:
    deadline = time.monotonic() + 5
    while True:
        try:
            return arrival.recv_ready(rx) if ready else arrival.recv(rx)
        except BlockingIOError:
            assert time.monotonic() < deadline, "the bytes sent never came"
            time.sleep(0.001)


@needs_compiled
@pytest.mark.parametrize("stamped", [True, False], ids=["kernel-stamped", "unstamped"])
def test_a_compiled_read_gives_what_the_python_read_gives(
        tcp_pair: tuple[socket.socket, socket.socket], stamped: bool) -> None:
    """Each path reads bytes that waited in the kernel 60 ms: the same bytes, the same clock,
    and (stamped) an arrival dated when they came, 60 ms before they were seen; unstamped,
    dated when seen. Against the time taken just before each send, in this run."""
    tx, rx = tcp_pair
    if stamped:
        assert stamps.enable_kernel_timestamps(rx)
    for ready in (False, True, False, True):
        arrival = stamps.Arrival(rx, time.perf_counter())
        payload = os.urandom(3000)
        sent = time.perf_counter()
        tx.sendall(payload)
        time.sleep(0.06)
        got = b""
        while len(got) < len(payload):
            got += _read(arrival, rx, ready)
        assert got == payload
        assert arrival.kernel is stamped and arrival.with_headers is False
        assert arrival.at <= arrival.seen
        if stamped:
            # Dated when the bytes came (within 30 ms of the send; the 60 ms sleep is the
            # margin that tells it from the time they were seen), never before they were sent.
            assert sent - 0.001 <= arrival.at <= sent + 0.03, (ready, arrival.at - sent)
            assert arrival.seen - arrival.at >= 0.03
        else:
            assert arrival.at == arrival.seen >= sent + 0.05


@needs_compiled
def test_a_compiled_read_of_nothing_and_of_a_closed_peer_are_pythons(
        tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    tx, rx = tcp_pair
    assert stamps.enable_kernel_timestamps(rx)
    arrival = stamps.Arrival(rx, time.perf_counter())
    with pytest.raises(BlockingIOError):
        arrival.recv_ready(rx)          # epoll was wrong, say: nothing there, and no wait
    with pytest.raises(BlockingIOError):
        arrival.recv(rx)
    tx.close()
    time.sleep(0.02)
    assert arrival.recv_ready(rx) == b""
    with pytest.raises(OSError):
        stamps._recv_stamped(-1, 100)   # type: ignore[misc]


@needs_compiled
@pytest.mark.timeout(120)
@pytest.mark.parametrize("eol", ["lf", "crlf"])
def test_whole_streams_read_compiled_and_in_python_have_the_same_events(
        server: str, eol: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Streams of the real test server read by the shared reader, with the compiled part and
    then with the Python it stands for: the same events, gaps and errors, kernel-timed both."""
    paths = [f"/s?n=25&gap_ms=3&eol={eol}", f"/s?n=12&skip=4,7&eol={eol}",
             f"/s?n=8&gap_ms=2&stall=5:400&eol={eol}", f"/s?n=6&gap_ms=30&garbage=3&eol={eol}",
             f"/s?n=30&gap_ms=4&eol={eol}"]
    fast_reads = _count_fast_reads(monkeypatch)
    compiled = run_streams(server, paths)
    # The compiled part read them: every stream's body but the one whose framing breaks
    # before its end (garbage=3 breaks the SSE, not the HTTP: that one too, here).
    assert fast_reads() >= sum(s.content_reads for s in compiled) - len(paths)
    monkeypatch.setattr(stamps, "_recv_stamped", None)
    monkeypatch.setattr(histogram, "_count_ms", None)
    monkeypatch.setattr(speedups, "Chunked", None)
    reads = fast_reads()
    python = run_streams(server, paths)
    assert fast_reads() == reads
    assert [essence(s) for s in compiled] == [essence(s) for s in python]
    assert [s.error for s in compiled] == [None, None, None, "protocol", None]
    assert compiled[2].stalls == python[2].stalls == 1
    for sample in (compiled[0], compiled[4], python[0], python[4]):
        if sample.content_reads > 1:
            assert sample.clock == "kernel"


_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def _llhttp(body: bytes, cuts: list[int]) -> tuple[str, bytes, object]:
    """geventhttpclient's parser (llhttp) fed the head, then ``body`` cut at ``cuts``: what
    it made of it (ok: the body and whether the message ended; err: its words)."""
    resp = HTTPResponse()
    resp.feed(_HEAD)
    try:
        for part in _cut(body, cuts):
            resp.feed(part)
    except HTTPParseError as exc:
        return "err", b"", exc.args[0]
    return "ok", bytes(resp._body_buffer), resp.message_complete


def _compiled(body: bytes, cuts: list[int]) -> tuple[str, bytes, object]:
    """The same bytes as the client reads them: the compiled part decodes them until it
    hands the body over, and the parser (standing at the body's first byte) reads the rest."""
    assert speedups.Chunked is not None
    fast = speedups.Chunked()
    resp = HTTPResponse()
    resp.feed(_HEAD)
    out, over = b"", False
    try:
        for part in _cut(body, cuts):
            if over:
                resp.feed(part)
                continue
            got, rest = fast.feed(part)
            out += got
            if rest is not None:
                over = True
                resp.feed(rest)
    except (HTTPParseError, ValueError) as exc:
        return "err", b"", exc.args[0]
    return "ok", out + bytes(resp._body_buffer), resp.message_complete


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


_chunk_data = st.binary(min_size=1, max_size=40)
_size_line = st.one_of(
    st.just("{:x}"), st.just("{:X}"), st.just("00{:x}"),
    st.sampled_from(["{:x};name=value", "{:x};a=\"q;\\\"x\"", "{:x} ", "{:x}\t;a", "{:x};",
                     " {:x}", "{:x};a b", "{:x};a=\x01"]),
)
_piece = st.one_of(
    st.tuples(_size_line, _chunk_data).map(
        lambda t: t[0].format(len(t[1])).encode("latin-1") + b"\r\n" + t[1] + b"\r\n"),
    st.tuples(st.just("{:x}"), _chunk_data).map(
        lambda t: t[0].format(len(t[1])).encode() + b"\r\n" + t[1] + b"\r\n"),
)
_ending = st.sampled_from([b"0\r\n\r\n", b"000\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n",
                           b"0;e=1\r\n\r\n", b"0\r\n\n", b"0\r\n: bad\r\n\r\n", b"",
                           b"0\r\n\r\nHTTP/1.1 200 OK\r\n"])


@needs_compiled
@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(_piece, max_size=6), ending=_ending,
       flip=st.one_of(st.none(), st.tuples(st.integers(min_value=0), st.binary(min_size=1,
                                                                               max_size=1))),
       cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=8))
@example(pieces=[b"5\r\nhello\r\n"], ending=b"0\r\n\r\n", flip=(7, b"\n"), cuts=[])
@example(pieces=[b"5\r\nhello\r\n"], ending=b"0\r\n\r\n", flip=(7, b"X"), cuts=[8])
@example(pieces=[b"5\r\nhello\r\n"], ending=b"", flip=None, cuts=[1, 2, 3, 4, 5, 6, 7, 8])
def test_chunked_bodies_decoded_compiled_equal_the_http_parsers(
        pieces: list[bytes], ending: bytes, flip: tuple[int, bytes] | None,
        cuts: list[int]) -> None:
    """Any chunked body, plain or not (extensions, trailers, whitespace, bad bytes), cut into
    reads anywhere: the compiled part and the parser it hands over to give the body llhttp
    gives, end the message where it does, and fail where it fails, in its words."""
    body = b"".join(pieces) + ending
    if flip is not None and body:
        at = flip[0] % len(body)
        body = body[:at] + flip[1] + body[at + 1:]
    llhttp, compiled = _llhttp(body, cuts), _compiled(body, cuts)
    assert compiled == llhttp


def _count_fast_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts the reads the compiled part's decoder makes (the real methods still run): those
    of ``_step_fast`` and those of the compiled steps (``FramedStep``) the streams were read
    with."""
    count = [0]
    steps: list[object] = []
    step, stepper = client._Stream._step_fast, client._Stream.stepper

    def counted(self: client._Stream, fast: speedups.ChunkedBody) -> object:
        count[0] += 1
        return step(self, fast)

    def kept(self: client._Stream) -> object:
        got = stepper(self)
        steps.append(got)
        return got

    monkeypatch.setattr(client._Stream, "_step_fast", counted)
    monkeypatch.setattr(client._Stream, "stepper", kept)
    return lambda: count[0] + sum(getattr(s, "reads", 0) for s in steps)


@needs_compiled
@pytest.mark.timeout(60)
@pytest.mark.parametrize("first_ms", [0, 30], ids=["first-event-with-head", "head-alone"])
def test_a_connection_read_by_the_compiled_part_is_reused(
        server: str, first_ms: int, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The compiled part hands the body's end to the HTTP parser, which ends the message: one
    client's requests go one after another over one connection, whether the first event came
    with the response head (decoded from the head's reads) or after it, and whether the body's
    end came with the final event or after it (read by the drain)."""
    fast_reads = _count_fast_reads(monkeypatch)
    plan = plan_for(server, f"/s?n=6&gap_ms=2&first_ms={first_ms}")
    c = StreamClient(plan)
    try:
        samples = [c.measure(RequestClassPlan(), random.Random(0)) for _ in range(6)]
    finally:
        c.close()
    assert [(s.error, s.content_events) for s in samples] == [(None, 6)] * 6
    assert [s.reused for s in samples] == [False] + [True] * 5
    assert fast_reads() >= 6 * 4


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(counts=st.dictionaries(st.integers(min_value=0, max_value=1 << 22),
                              st.integers(min_value=1, max_value=1 << 40), max_size=300))
def test_a_histograms_counts_are_written_compiled_as_in_python(counts: dict[int, int]) -> None:
    """HdrHistogram V2's counts payload (ZigZag LEB128, runs of empty buckets negative):
    the same bytes from the compiled writer as from the Python one, for any buckets."""
    assert speedups.varints is not None and speedups.pairs_le32 is not None
    assert speedups.varints(counts) == histogram._varints_py(counts)
    table = {k: c & 0xFFFFFFFF for k, c in counts.items()}
    assert speedups.pairs_le32(table) == histogram._pairs_le32_py(table)


@needs_compiled
@pytest.mark.parametrize("n, top", [(31, 1 << 22), (32, 1 << 22), (1024, 1 << 22),
                                    (20_000, 1 << 22), (5_000, 1 << 17), (3_000, 1 << 40),
                                    (500, 1 << 61)])
def test_many_buckets_are_written_compiled_as_in_python(n: int, top: int) -> None:
    """From 32 buckets on the compiled writer sorts them by radix, a byte of the index a pass
    (as many passes as the largest index has bytes; below 32, by insertion): the same bytes
    as Python's."""
    assert speedups.varints is not None and speedups.pairs_le32 is not None
    rng = random.Random(n)
    counts = {rng.randrange(top): rng.randrange(1, 1 << 33) for _ in range(n)}
    assert speedups.varints(counts) == histogram._varints_py(counts)
    # The same sort, for the time batches' and the seconds' packed tables (uint32 each).
    if top <= 1 << 32:
        table = {k: c & 0xFFFFFFFF for k, c in counts.items()}
        assert speedups.pairs_le32(table) == histogram._pairs_le32_py(table)


@needs_compiled
def test_a_histogram_past_the_python_writers_size_is_written_sparse_and_reads_back() -> None:
    """Compiled, every histogram is written by the sparse writer (in Python, one past
    _SPARSE_ENCODE_MAX buckets goes to hdrh's dense encoder): hdrh reads it back to the same
    counts as the dense blob."""
    from hdrh.histogram import HdrHistogram

    h = histogram.SparseHistogram(4)
    rng = random.Random(5)
    h.record_ms([rng.uniform(1, 900) for _ in range(5000)])
    assert len(h.counts) > histogram._SPARSE_ENCODE_MAX
    compiled_blob = h._encode()
    dense_blob = h._encode_dense()
    assert compiled_blob == h._encode_sparse() != dense_blob
    for blob in (compiled_blob, dense_blob):
        theirs = HdrHistogram.decode(blob.encode("ascii"))
        assert theirs.get_total_count() == h.total
        assert histogram.SparseHistogram.decode(blob, 4).counts == h.counts
