"""Event times from the kernel's receive stamps (SO_TIMESTAMPNS), against real servers on
127.0.0.1: a read our loop got to late still dates its bytes when they arrived; TLS falls back
to the time our code saw them and says so; a stall of our own loop is not the server's."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gevent
import gevent.socket
import pytest

from streamquake.loadgen import self_measure
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.stamps import Arrival, enable_kernel_timestamps
from tests.helpers import self_signed_cert
from tests.test_client import measure, plan_for, start_server

BLOCK_S = 0.2


class _Writer:
    """A TCP server in a thread that writes given bytes at given delays once the client says
    go, and notes (perf_counter) when each write began (``sending``) and ended (``sent``): on
    loopback, the bytes arrive in between."""

    def __init__(self, writes: list[tuple[float, bytes]]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.writes = writes
        self.sending: list[float] = []
        self.sent: list[float] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.listener:
            conn, _ = self.listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            conn.recv(1)        # the client stamps what it receives from now on
            for delay, data in self.writes:
                time.sleep(delay)
                self.sending.append(time.perf_counter())
                conn.sendall(data)
                self.sent.append(time.perf_counter())
            conn.recv(1)        # until the client closes

    def connect(self) -> gevent.socket.socket:
        sock = gevent.socket.create_connection(self.listener.getsockname())
        assert enable_kernel_timestamps(sock)
        sock.sendall(b"g")
        return sock


@pytest.mark.timeout(20)
def test_a_late_read_still_dates_the_bytes_when_they_arrived() -> None:
    server = _Writer([(0.0, b"data: one\n\n")])
    sock = server.connect()
    try:
        while not server.sent:
            time.sleep(0.001)
        time.sleep(BLOCK_S)     # the reading thread (and its hub) is busy elsewhere
        arrival = Arrival(sock, floor=0.0)
        reading = time.perf_counter()
        data = arrival.recv(sock)
        read = time.perf_counter()
    finally:
        sock.close()
        server.thread.join(5)
    late = arrival.seen - arrival.at
    print(f"\nkernel stamp {(arrival.at - server.sent[0]) * 1000:+.2f} ms from the write, "
          f"user-space time {(arrival.seen - server.sent[0]) * 1000:+.2f} ms")
    assert data == b"data: one\n\n" and arrival.kernel
    # Dated when the bytes arrived (during the write, 1-10 ms allowed for carrying the stamp
    # over from the wall clock), seen when the late read returned: however late that was.
    assert server.sending[0] - 0.001 <= arrival.at <= server.sent[0] + 0.01, \
        (arrival.at, server.sending, server.sent)
    assert reading <= arrival.seen <= read and late >= BLOCK_S - 0.005, late


@pytest.mark.timeout(20)
def test_events_in_one_read_share_the_stamp_of_its_newest_segment() -> None:
    # Measured: TCP reports the stamp of the latest segment a read returns (waiting segments
    # are coalesced and keep the newest stamp), so a read never dates bytes too early.
    server = _Writer([(0.0, b"data: a\n\n"), (0.1, b"data: b\n\n")])
    sock = server.connect()
    try:
        while len(server.sent) < 2:
            time.sleep(0.001)
        time.sleep(0.05)
        arrival = Arrival(sock, floor=0.0)
        data = arrival.recv(sock)
    finally:
        sock.close()
        server.thread.join(5)
    assert data == b"data: a\n\ndata: b\n\n" and arrival.kernel
    assert server.sending[1] - 0.001 <= arrival.at <= server.sent[1] + 0.01, \
        (arrival.at, server.sending, server.sent)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(tmp_path_factory.mktemp("sse"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(tmp)
    yield from start_server(tmp, str(cert), str(key))


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[self_measure.Guard]:
    g = self_measure.start(None, tmp_path)
    assert g is not None
    try:
        yield g
    finally:
        self_measure.stop()


# The second event comes 600 ms after the first; our hub is blocked from 250 ms to 1050 ms,
# so we see it ~1050 ms after the first. Stall threshold 800 ms: by the kernel's stamps the
# server was on time, by our own reading it was not.
GAP_MS, BLOCK_FROM_S, BLOCKED_S, STALL_MS = 600, 0.25, 0.8, 800


@dataclass
class Blocked:
    sample: RequestSample
    block: tuple[float, float]      # when our hub was blocked (epoch s, start and end)

    def first_event_at(self) -> float:
        """Epoch s of the first event, by the sample's own clock."""
        assert self.sample.ttft_ms is not None
        return self.sample.sent + self.sample.ttft_ms / 1000


def _blocked_stream(url: str, **plan: object) -> Blocked:
    """The stream of two events 600 ms apart, our hub blocked from 250 ms to 1050 ms. The first
    event must come before the block, as a warm server's does at once; on a busy machine it may
    not, and then the stream is measured again (the deadline is for a hang)."""
    warm = measure(plan_for(url, "/?n=1", **plan))       # a warm server answers at once
    assert warm.error is None, warm.error_detail
    deadline = time.monotonic() + 60
    while True:
        got = _blocked_stream_once(url, **plan)
        if got.sample.error is not None or got.first_event_at() < got.block[0]:
            return got
        assert time.monotonic() < deadline, "the first event never came before the block"


def _blocked_stream_once(url: str, **plan: object) -> Blocked:
    # The client first (a TLS context takes a while to build), then the clock starts.
    client = StreamClient(plan_for(url, f"/?n=2&gap_ms={GAP_MS}", stall_threshold_ms=STALL_MS,
                                   **plan), environ={})
    block: list[float] = []

    def blocking() -> None:
        block.append(time.time())
        time.sleep(BLOCKED_S)
        block.append(time.time())

    gevent.get_hub().loop.update_now()     # timers count from now, not the loop's last turn
    blocker = gevent.spawn_later(BLOCK_FROM_S, blocking)
    try:
        sample = client.measure(RequestClassPlan(), random.Random(0))
    finally:
        blocker.join()
        client.close()
    return Blocked(sample, (block[0], block[1]))


@pytest.mark.timeout(90)
def test_a_stall_of_our_own_loop_is_a_client_stall_by_the_kernels_stamps(server: str) -> None:
    got = _blocked_stream(server)
    s = got.sample
    assert s.error is None, s.error_detail
    assert s.clock == "kernel"
    # The gap is the server's 600 ms (never less), not what our blocked loop saw: that would
    # be at least from the first event to the block's end (~1000 ms).
    seen_gap_ms = (got.block[1] - got.first_event_at()) * 1000
    assert len(s.itl_ms) == 1 and GAP_MS - 20 <= s.itl_ms[0] < seen_gap_ms - 20, \
        (s.itl_ms, seen_gap_ms)
    assert (s.stalls, s.client_stalls) == (0, 1)


@pytest.mark.timeout(90)
def test_tls_falls_back_to_user_time_and_says_so(tls_server: str) -> None:
    got = _blocked_stream(tls_server, verify_tls=False)
    s = got.sample
    assert s.error is None, s.error_detail
    assert s.clock == "user"
    # No kernel stamps through TLS: the gap is what our late loop saw (the second event was
    # read only after the block), and with nothing to say the loop was late (no guard
    # running), the stall is the server's. The first event was read before the block (no
    # read happens in it), the second after: the gap holds the whole block, 800 ms and more
    # against the server's 600. (Not against the block's end less the first event's epoch
    # time: the sample's epoch and monotonic clocks are read a moment apart, and a busy
    # machine put 9 ms between them.)
    blocked_ms = (got.block[1] - got.block[0]) * 1000
    assert len(s.itl_ms) == 1 and s.itl_ms[0] >= blocked_ms - 1, (s.itl_ms, blocked_ms)
    assert (s.stalls, s.client_stalls) == (1, 0)


@pytest.mark.timeout(90)
def test_tls_stall_during_hub_lag_is_a_client_stall(tls_server: str,
                                                    guard: self_measure.Guard) -> None:
    s = _blocked_stream(tls_server, verify_tls=False).sample
    assert s.error is None, s.error_detail
    assert s.clock == "user"
    # The saturation guard's probe saw the hub ~800 ms late within that gap: the gap less that
    # is under the threshold, so the stall was the load process's own.
    assert (s.stalls, s.client_stalls) == (0, 1)
