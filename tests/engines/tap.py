"""An independent reader of what an engine sent: a TCP relay on loopback that passes every byte
between a client and the engine unchanged, and keeps each connection's bytes with the kernel's
receive stamp (``SO_TIMESTAMPNS``), the way a packet capture would. After the run, ``exchanges``
reads them with h11 (HTTP/1.1, chunked bodies) and a few lines of SSE parsing of its own, so no
figure it gives comes from streamquake's client or parser.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import h11

from tests.timing import HANG_S

_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_ANCILLARY = socket.CMSG_SPACE(16)
_BOTH_DONE = {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}


@dataclass
class Segment:
    t: float                          # epoch s the bytes reached this machine (the kernel's)
    data: bytes


@dataclass
class Conn:
    request: list[Segment] = field(default_factory=list)
    response: list[Segment] = field(default_factory=list)


@dataclass
class Event:
    t: float                          # when the segment that completed the event came in
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class Exchange:
    """One request and the events of its answer, as the wire carried them."""

    request_t: float                  # when the request's last byte came in
    request: dict[str, Any]
    status: int
    headers: dict[str, str]
    events: list[Event]


def _recv(sock: socket.socket) -> Segment | None:
    data, anc, _flags, _addr = sock.recvmsg(65536, _ANCILLARY)
    if not data:
        return None
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", raw[:16])
            return Segment(sec + nsec / 1e9, data)
    raise AssertionError("the kernel gave no receive stamp")


class Tap:
    """``with Tap(upstream_port) as tap:`` point the client at ``tap.url``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.conns: list[Conn] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        # set before accept: an accepted socket inherits it, so its first bytes get stamps too
        self._listener.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self.failures: list[Exception] = []
        # The longest any bytes waited in this relay (their kernel stamp to the end of their
        # send on): a relay that falls behind on a busy machine passes on in bursts what came
        # apart, and a client after it sees the bursts, not the engine's timing.
        self.lag_max_s = 0.0
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> Tap:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for s in self._sockets:           # wakes a pump still waiting on an idle connection
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(HANG_S)
        for s in [*self._sockets, self._listener]:
            s.close()

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=HANG_S)
            except OSError as exc:
                self.failures.append(exc)
                client.close()
                continue
            conn = Conn()
            self.conns.append(conn)
            for s in (client, upstream):
                self._sockets.append(s)
                s.settimeout(HANG_S)
            upstream.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            self._spawn(self._pump, client, upstream, conn.request)
            self._spawn(self._pump, upstream, client, conn.response)

    def _pump(self, src: socket.socket, dst: socket.socket, into: list[Segment]) -> None:
        try:
            while seg := _recv(src):
                into.append(seg)
                dst.sendall(seg.data)
                self.lag_max_s = max(self.lag_max_s, time.time() - seg.t)
        except OSError:
            pass                          # a side that went away ends its pumps
        except Exception as exc:          # reported by exchanges()
            self.failures.append(exc)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def exchanges(self) -> Iterator[Exchange]:
        assert not self.failures, f"the tap failed: {self.failures}"
        for conn in self.conns:
            yield from read(conn)


def _request_ends(conn: Conn) -> Iterator[tuple[float, dict[str, Any]]]:
    parser = h11.Connection(h11.SERVER)
    body = b""
    for seg in conn.request:
        parser.receive_data(seg.data)
        while (ev := parser.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            if isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                yield seg.t, json.loads(body)
                body = b""
                parser.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                parser.send(h11.EndOfMessage())
                if parser.our_state is h11.DONE and parser.their_state is h11.DONE:
                    parser.start_next_cycle()


def read(conn: Conn) -> Iterator[Exchange]:
    """The exchanges one connection carried, in order."""
    requests = _request_ends(conn)
    if not conn.response:
        # a connection that carried no answer: a reachability check, or a request unanswered
        yield from (Exchange(t, request, 0, {}, []) for t, request in requests)
        return
    parser = h11.Connection(h11.CLIENT)
    exchange: Exchange | None = None
    text = codecs.getincrementaldecoder("utf-8")()
    buf = ""
    for seg in [*conn.response, Segment(conn.response[-1].t, b"")]:
        if seg.data and (parser.our_state is h11.IDLE or parser.states == _BOTH_DONE):
            if parser.states == _BOTH_DONE:
                parser.start_next_cycle()
            # h11 reads an answer only after "sending" its request: the real one went by.
            parser.send(h11.Request(method="POST", target="/", headers=[
                ("host", "tap"), ("content-length", "0")]))
            parser.send(h11.EndOfMessage())
        parser.receive_data(seg.data)
        while True:
            try:
                ev = parser.next_event()
            except h11.RemoteProtocolError:   # the answer broke off: what came is the answer
                if exchange is not None:
                    yield exchange
                return
            if ev in (h11.NEED_DATA, h11.PAUSED) or isinstance(ev, h11.ConnectionClosed):
                break
            if isinstance(ev, h11.Response):
                request_t, request = next(requests)
                exchange = Exchange(request_t, request, ev.status_code,
                                    {k.decode(): v.decode() for k, v in ev.headers}, [])
                text.reset()
                buf = ""
            elif isinstance(ev, h11.Data) and exchange is not None:
                buf += text.decode(ev.data)
                *blocks, buf = buf.replace("\r\n", "\n").split("\n\n")
                for block in blocks:
                    data = [ln[5:].removeprefix(" ") for ln in block.split("\n")
                            if ln.startswith("data:")]
                    if data:
                        exchange.events.append(Event(seg.t, "\n".join(data)))
            elif isinstance(ev, h11.EndOfMessage) and exchange is not None:
                yield exchange
                exchange = None
