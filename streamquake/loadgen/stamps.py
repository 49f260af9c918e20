"""When a request's bytes went out and came in: socket write and first-byte stamps, the steps
of getting a socket (_Conn), and kernel receive timestamps for the body's reads.

Event times come from the kernel where it can say: plain TCP sockets get ``SO_TIMESTAMPNS``
at connect and are read with ``recvmsg``, whose ``SCM_TIMESTAMPNS`` says when the bytes came in,
whenever our greenlet got to them. For TCP that stamp is the arrival of the *latest* segment the
read returns (segments waiting in the receive queue are coalesced and keep the newest stamp),
so it never dates bytes before they arrived. TLS sockets cannot ``recvmsg`` (and their records
are decrypted in user space anyway): they, and any read the kernel gave no stamp, are timed
when our code saw them, and the sample says which clock it used (``clock``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Any

import gevent
import gevent.socket
import gevent.ssl
from gevent.monkey import get_original
from geventhttpclient.response import HTTPConnectionClosed, HTTPParseError, HTTPSocketResponse

from streamquake.loadgen import speedups
from streamquake.loadgen.failures import _Failed, _StreamTimeout
from streamquake.loadgen.samples import RequestSample

_BLOCK = 64 * 1024
_YIELD_S = 0.01         # a socket that never runs dry must still let other users run
# Linux's value (asm-generic; x86, arm); Python 3.11 does not name it. With it set, a TCP
# socket's recvmsg carries SCM_TIMESTAMPNS (same number): a struct timespec, CLOCK_REALTIME.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_SOL_SOCKET = socket.SOL_SOCKET
_TIMESPEC = struct.Struct("@ll")
_CMSG_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)
# A response's head (status line and headers) at most this many bytes: real ones are a few
# KiB (nginx refuses requests past 32 KiB of headers); past it the request is a ``limit`` error.
_HEAD_MAX = 256 * 1024
# The bytes of a response head's reads kept for client.py (head_bytes): far more than heads take.
_HEAD_KEEP = 64 * 1024
# Where the greenlet reading a response's head keeps its _HeadBudget (None otherwise).
_HEAD = "sq_head"
# Where the writing greenlet notes when its request's last byte was written (perf_counter s).
_WRITTEN = "sq_written"
# Where the greenlet that asked the pool for a socket notes how it got one (a _Conn).
_CONN = "sq_conn"
# Where a request's greenlet is told when its response's first bytes arrived: None while it
# waits for them (set at the attempt's start), then (perf_counter s, from the kernel's stamp).
_FIRST_BYTE = "sq_first_byte"
_TAKEN = (0.0, False)
# Test-only: hold every request write back this long (tests/test_send_stamp.py); unset in use.
_WRITE_HOLD_S = float(os.environ.get("STREAMQUAKE_TEST_WRITE_HOLD_MS") or 0) / 1000.0


def _note_written() -> None:
    setattr(gevent.getcurrent(), _WRITTEN, time.perf_counter())


def _note_first_byte(ancillary: list[tuple[int, int, bytes]]) -> None:
    """Tell the greenlet reading a response when its first bytes arrived: ``(at, kernel)``,
    ``at`` in perf_counter seconds, from the kernel's stamp where there is one."""
    seen = time.perf_counter()
    at, kernel = seen, False
    if ancillary:
        level, kind, raw = ancillary[0]
        if kind == SO_TIMESTAMPNS and level == _SOL_SOCKET:
            sec, nsec = _TIMESPEC.unpack_from(raw)
            at, kernel = seen - max(0.0, time.time() - (sec + nsec * 1e-9)), True
    setattr(gevent.getcurrent(), _FIRST_BYTE, (at, kernel))


class _HeadBudget:
    """What reading one response's head (status line, headers, any 1xx before them) may
    take: bytes up to ``_HEAD_MAX`` and time up to the request's deadline. geventhttpclient
    reads the head in a loop of its own that keeps what it reads; a socket that never runs
    dry never yields there, so the request's gevent timeout alone cannot end it (issue 37)."""

    __slots__ = ("deadline", "left", "next_yield")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.left = _HEAD_MAX
        # From the head's first read: the wait for it (the server's time to answer) let the
        # other users run already, and a head that comes in one read never yields.
        self.next_yield = math.inf

    def took(self, nbytes: int) -> None:
        now = time.perf_counter()
        if now > self.deadline:
            raise _StreamTimeout()
        self.left -= nbytes
        if self.left < 0:
            raise _Failed("limit", f"response headers longer than {_HEAD_MAX // 1024} KiB "
                                   "(the client's limit on a response's head): the target "
                                   "sent header lines without end")
        if not nbytes:
            return
        if self.next_yield == math.inf:
            self.next_yield = now + _YIELD_S
        elif now >= self.next_yield:
            gevent.idle()       # let the other users (and the request's timeout) run
            self.next_yield = time.perf_counter() + _YIELD_S


def _head_budget() -> _HeadBudget | None:
    budget: _HeadBudget | None = getattr(gevent.getcurrent(), _HEAD, None)
    return budget


class _WriteStamp:
    """Tells the greenlet writing on a pool socket when its write returned: a request is dated
    from its last byte written, not from when the client began to send it. Its reads of a
    response's head are held to the greenlet's ``_HeadBudget``."""

    def sendall(self, data: object, flags: int = 0) -> None:
        if _WRITE_HOLD_S:
            gevent.sleep(_WRITE_HOLD_S)
        super().sendall(data, flags)  # type: ignore[misc]
        _note_written()

    def recv(self, *args: Any, **kw: Any) -> bytes:
        data: bytes = super().recv(*args, **kw)  # type: ignore[misc]
        budget = _head_budget()
        if budget is not None:
            budget.took(len(data))
        return data


class _StampedSocket(_WriteStamp, gevent.socket.socket):  # type: ignore[misc]
    """A plain pool socket (the pool creates these); it also notes its connect (_Conn), and
    when the first bytes of a response arrived (_note_first_byte)."""

    # The bytes of the reads that brought the latest response's head (head_bytes), up to
    # _HEAD_KEEP: client.py's _Stream.hand_over finds where the parser stands in its body.
    sq_head: bytes | None = None

    def recv(self, size: int, flags: int = 0) -> bytes:
        first = not flags and getattr(gevent.getcurrent(), _FIRST_BYTE, _TAKEN) is None
        if first:
            # The response's first read (geventhttpclient reads the head with recv): a peek
            # through recvmsg first, for the kernel's receive stamp, as events get theirs
            # (Arrival.recv); the read itself is the usual one.
            data, ancillary, _flags, _addr = self.recvmsg(1, _CMSG_BYTES, socket.MSG_PEEK)
            if data:
                _note_first_byte(ancillary)
        got: bytes = super().recv(size, flags)
        if first:
            self.sq_head = got
        elif self.sq_head is not None and _head_budget() is not None:
            # Only the head's reads (a drain's reads of a body are not kept, nor copied).
            self.sq_head = self.sq_head + got if len(self.sq_head) < _HEAD_KEEP else None
        return got

    def connect(self, address: object) -> None:
        conn = _conn()
        if conn is not None and conn.connect_start is None:
            conn.connect_start = time.perf_counter()   # the first address tried
        super().connect(address)
        if conn is not None:
            conn.connected = time.perf_counter()


class _StampedSSLSocket(_WriteStamp, gevent.ssl.SSLSocket):  # type: ignore[misc]
    """A TLS pool socket (the context wraps the TCP socket in this class)."""


@dataclass(slots=True)
class _Conn:
    """How the pool got one request its socket (perf_counter s): a name resolved, a TCP connect,
    a TLS handshake, or none of these (a pooled connection); ``ready`` when it handed it over."""

    dns_s: float | None = None
    connect_start: float | None = None
    connected: float | None = None
    handshaken: float | None = None
    ready: float | None = None

    def parts(self, s: RequestSample, written: float) -> None:
        """``send_ms`` in parts, on a request whose last byte was ``written``."""
        s.reused = self.connect_start is None
        if self.dns_s is not None:
            s.dns_ms = self.dns_s * 1000.0
        if self.connect_start is not None and self.connected is not None:
            s.connect_ms = (self.connected - self.connect_start) * 1000.0
            if self.handshaken is not None:
                s.tls_ms = (self.handshaken - self.connected) * 1000.0
        if self.ready is not None:
            s.write_ms = (written - self.ready) * 1000.0


def _conn() -> _Conn | None:
    conn: _Conn | None = getattr(gevent.getcurrent(), _CONN, None)
    return conn


def _after_connect(sock: socket.socket) -> None:
    """The pool's hook on each new connection, once it is connected (and its TLS handshake
    done: the context wraps the socket with ``do_handshake_on_connect``)."""
    enable_kernel_timestamps(sock)
    conn = _conn()
    if conn is not None and _is_tls(sock):
        conn.handshaken = time.perf_counter()


# The C library's own getaddrinfo (gevent's monkey-patching, Locust's, replaces ``socket``'s):
# for a numeric host it only parses, and never blocks.
_getaddrinfo = get_original("socket", "getaddrinfo")


def _instrument(pool: Any, receive_buffer: int | None) -> None:
    """Time the steps of geventhttpclient's ConnectionPool on the greenlet that asks it for a
    socket (get_socket -> _resolve -> _create_tcp_socket -> connect -> TLS -> after_connect),
    through the pool's own hooks and methods."""
    get_socket, resolve = pool.get_socket, pool._resolve
    try:
        ipaddress.ip_address(pool._connection_host.strip("[]"))
        named = False            # an IP address: nothing to resolve (getaddrinfo just parses it)
    except ValueError:
        named = True

    def timed_get_socket() -> object:
        conn = _Conn()
        setattr(gevent.getcurrent(), _CONN, conn)
        sock = get_socket()
        conn.ready = time.perf_counter()
        return sock

    def timed_resolve() -> object:
        if not named:
            # What the pool's own _resolve asks, answered here: gevent's getaddrinfo would
            # send even an address to its resolver's thread pool: a thread's round trip per
            # new connection for what the C library answers by parsing.
            return _getaddrinfo(pool._connection_host, pool._connection_port,
                                socket.AF_INET if pool.disable_ipv6 else 0, socket.SOCK_STREAM,
                                socket.SOL_TCP, socket.AI_NUMERICHOST)
        start = time.perf_counter()
        infos = resolve()
        if named and (conn := _conn()) is not None:
            conn.dns_s = time.perf_counter() - start
        return infos

    def create_tcp_socket(family: int, socktype: int, proto: int) -> _StampedSocket:
        sock = _StampedSocket(family, socktype, proto)
        if receive_buffer is not None:
            # Before the connect: the window the handshake offers comes from it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        return sock

    for name, hook in (("get_socket", timed_get_socket), ("_resolve", timed_resolve),
                       ("_create_tcp_socket", create_tcp_socket),
                       ("after_connect", _after_connect)):
        setattr(pool, name, hook)


def _is_tls(sock: object) -> bool:
    return isinstance(sock, gevent.ssl.SSLSocket | ssl.SSLSocket)


def enable_kernel_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp what this socket receives from now on (bytes already queued get
    no stamp); False where it cannot (TLS, another OS)."""
    if _is_tls(sock):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


class Arrival:
    """When the body bytes of the latest read arrived (``at``) and when our code saw them
    (``seen``), both perf_counter seconds; ``kernel`` says whether ``at`` came from the kernel.

    ``at`` never goes back: not before the previous read's, nor before the response headers
    were seen (``floor``), so that a stream's times stay ordered whatever the wall clock does.
    ``with_headers``: the latest bytes came in the headers' read (timed at the headers).
    """

    __slots__ = ("at", "seen", "kernel", "with_headers", "plain")

    def __init__(self, sock: object, floor: float) -> None:
        self.at = self.seen = floor
        self.kernel = self.with_headers = False
        self.plain = sock is not None and not _is_tls(sock)   # read with recvmsg, stamped

    def buffered(self) -> None:
        """Bytes the HTTP parser already held came in the headers' read: they arrived by the
        time the headers were seen (``at`` stays there), and no kernel stamp says when."""
        self.seen = time.perf_counter()
        self.kernel, self.with_headers = False, True

    def recv_ready(self, sock: socket.socket, size: int = _BLOCK) -> bytes:
        """:meth:`recv` of a plain socket that epoll said is ready (the shared reader's):
        it never waits (nothing there after all: BlockingIOError), and runs compiled where
        the compiled part is built (speedups.py)."""
        if _recv_stamped is None or not self.plain:
            return self.recv(sock, size)
        data, seen, lag = _recv_stamped(sock.fileno(), size)
        self.stamped(seen, lag)
        return data

    def stamped(self, seen: float, lag: float) -> None:
        """A compiled read's times: seen at ``seen`` (perf_counter s), stamped by the kernel
        ``lag`` seconds before that (-1.0: no stamp)."""
        self.seen, self.with_headers = seen, False
        if lag < 0.0:
            self.at, self.kernel = max(self.at, seen), False
        else:
            self.at, self.kernel = max(self.at, seen - lag), True

    def recv(self, sock: socket.socket, size: int = _BLOCK) -> bytes:
        stamp: float | None = None
        data: bytes
        if self.plain:
            data, ancillary, _flags, _addr = sock.recvmsg(size, _CMSG_BYTES)
            if ancillary:       # room for one message: the stamp, when there is one
                level, kind, raw = ancillary[0]
                if kind == SO_TIMESTAMPNS and level == _SOL_SOCKET:
                    sec, nsec = _TIMESPEC.unpack_from(raw)
                    stamp = sec + nsec * 1e-9
        else:
            data = sock.recv(size)
        seen = time.perf_counter()
        self.seen, self.with_headers = seen, False
        if stamp is None:
            self.at, self.kernel = max(self.at, seen), False
        else:
            # The stamp is CLOCK_REALTIME: carry its distance from now over to perf_counter.
            self.at = max(self.at, seen - max(0.0, time.time() - stamp))
            self.kernel = True
        return data


_recv_stamped = speedups.recv_stamped


def head_bytes(sock: object) -> bytes | None:
    """The bytes of the reads that brought a plain pool socket's latest response head; None
    where they were not kept (another socket, more than _HEAD_KEEP)."""
    head = getattr(sock, "sq_head", None)
    return head if isinstance(head, bytes) else None


def _read_some(resp: HTTPSocketResponse, deadline: float, arrival: Arrival | None = None,
               size: int = _BLOCK) -> bytes:
    """Body bytes available now, after at most one ``recv`` (of at most ``size`` bytes) that
    brings some; b"" once the body has ended. Raises _StreamTimeout past ``deadline``
    (perf_counter seconds) even while the socket keeps delivering bytes that carry no body
    (chunk framing, say). ``arrival``, if given, is told when the returned bytes arrived.

    Uses the response's parser buffer and socket directly: the public ``read(n)`` waits for
    ``n`` bytes, which would hold early events back until later ones arrive.
    """
    buf = resp._body_buffer
    if buf and arrival is not None:
        arrival.buffered()
    while not buf:
        if resp.message_complete:
            return b""
        sock = resp._sock
        if sock is None:
            raise HTTPConnectionClosed("connection closed")
        data = sock.recv(size) if arrival is None else arrival.recv(sock, size)
        if not data:
            # The peer closed: that ends a body without framing, and cuts any other short.
            with contextlib.suppress(HTTPParseError):
                resp.feed(data)
            if not resp.message_complete:
                raise HTTPConnectionClosed("connection closed")
            break
        resp.feed(data)   # broken framing (an invalid chunk size, say) raises HTTPParseError
        if not buf and time.perf_counter() > deadline:
            raise _StreamTimeout()
    out = bytes(buf)
    del buf[:]
    return out
