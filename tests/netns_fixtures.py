"""Namespaces and TCP servers for the network tests, on this kernel and inside UML alike."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from pyroute2 import netns as pr_netns

from streamquake.faults.tc.netns import NamespaceTopology, entered, iproute

Serve = Callable[[str, str, Callable[[socket.socket], None]], int]


@pytest.fixture
def client_ns() -> Iterator[str]:
    """A namespace of the test's own for the client side, with loopback up."""
    name = f"sqtest-{uuid.uuid4().hex[:8]}"
    pr_netns.create(name)
    with iproute(name) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
    yield name
    pr_netns.remove(name)


@pytest.fixture
def topo(client_ns: str) -> Iterator[NamespaceTopology]:
    with NamespaceTopology(host_netns=client_ns) as t:
        yield t


def tcp_socket(ns: str) -> socket.socket:
    """A TCP socket created inside namespace ``ns``; Nagle off so small answers leave at once."""
    with entered(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(20)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start TCP servers in a namespace; each connection goes to ``handler(conn)``."""
    listening: list[socket.socket] = []

    def start(ns: str, addr: str, handler: Callable[[socket.socket], None]) -> int:
        srv = tcp_socket(ns)
        srv.bind((addr, 0))
        srv.listen(64)
        listening.append(srv)

        def handle(conn: socket.socket) -> None:
            with conn, contextlib.suppress(OSError):
                handler(conn)

        def loop() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()
        return int(srv.getsockname()[1])

    yield start
    for srv in listening:
        with contextlib.suppress(OSError):
            srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() above
        srv.close()
