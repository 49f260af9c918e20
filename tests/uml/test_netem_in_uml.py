"""netem through pyroute2, proven in a kernel that has it: User-Mode Linux.

These run only inside UML (scripts/uml-run sets STREAMQUAKE_UML=1); the normal suite boots UML
and runs them from tests/test_netem_uml_gate.py, which fails if UML cannot boot or any of these
fails. Outside UML they are skipped with that pointer.

Every measurement uses real TCP servers in the target's namespace and clients in a namespace
standing in for the load generator's, behind NamespaceTopology's veth pair.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from streamquake.faults.contract import RunContext
from streamquake.faults.tc.netem import (
    NetemFault,
    NetemInjector,
    load_table,
    network_profile_fault,
)
from streamquake.faults.tc.netns import NamespaceTopology
from streamquake.faults.tc.tbf import TbfFault, TbfInjector
from streamquake.journal import Journal
from streamquake.scenario.network import NetworkConfig
from tests.netns_fixtures import Serve, tcp_socket

pytestmark = [
    pytest.mark.uml,
    pytest.mark.skipif(os.environ.get("STREAMQUAKE_UML") != "1",
                       reason="runs inside User-Mode Linux: tests/test_netem_uml_gate.py runs it"),
]

REQUEST = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


# ---------------------------------------------------------------------------- tools


def http_like(conn: socket.socket) -> None:
    """Answer every request on a kept-alive connection at once."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    while chunk := conn.recv(4096):
        buf += chunk
        while b"\r\n\r\n" in buf:
            _, buf = buf.split(b"\r\n\r\n", 1)
            conn.sendall(RESPONSE)


def echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while chunk := conn.recv(4096):
        conn.sendall(chunk)


def sink(conn: socket.socket) -> None:
    first, total, t0, t1 = 0, 0, 0.0, 0.0
    while chunk := conn.recv(65536):
        now = time.perf_counter()
        if not total:
            first, t0 = len(chunk), now
        total, t1 = total + len(chunk), now
    conn.sendall(str((total - first) / max(t1 - t0, 1e-9)).encode())


def connect_ms(ns: str, addr: str, port: int, n: int) -> list[float]:
    """Times of ``n`` TCP connects; one untimed connect first resolves the neighbour (ARP)."""
    with tcp_socket(ns) as warm:
        warm.connect((addr, port))
    out = []
    for _ in range(n):
        s = tcp_socket(ns)
        t0 = time.perf_counter()
        s.connect((addr, port))
        out.append((time.perf_counter() - t0) * 1000)
        s.close()
    return out


def ttfb_ms(conn: socket.socket) -> float:
    """From sending a request to the first byte of its answer, on a connected socket."""
    t0 = time.perf_counter()
    conn.sendall(REQUEST)
    first = conn.recv(len(RESPONSE))
    elapsed = (time.perf_counter() - t0) * 1000
    got = len(first)
    while got < len(RESPONSE):
        got += len(conn.recv(len(RESPONSE) - got))
    return elapsed


def warm_ttfb_ms(ns: str, addr: str, port: int, n: int) -> list[float]:
    """TTFB of ``n`` requests on one kept-alive connection (after an untimed first one).

    A warm connection keeps the server's per-connection start-up out of the numbers: with a
    delay, that start-up would hide inside the wait and shrink the measured shift.
    """
    with tcp_socket(ns) as s:
        s.connect((addr, port))
        ttfb_ms(s)
        return [ttfb_ms(s) for _ in range(n)]


def tc(ns: str, *args: str) -> str:
    return subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True,
                          text=True).stdout


class Applied:
    """A netem fault applied through the injector; reverted (and checked gone) on exit."""

    def __init__(self, topo: NamespaceTopology, client_ns: str, port: int,
                 fields: dict[str, Any], **network: Any) -> None:
        net = NetworkConfig(**network)
        self.topo, self.client_ns = topo, client_ns
        ctx = RunContext(topo.target_addr, port, Path("/tmp"),
                         target_netns=topo.netns if net.mode == "namespace" else None,
                         client_netns=client_ns, network=net)
        self.injector = NetemInjector(NetemFault.model_validate(fields), ctx)
        self.entry = Journal().add("netem", "uml")

    def __enter__(self) -> dict[str, Any]:
        assert self.injector.preflight() == []
        # The configured view is the record's (describe, complete once applied); apply returns
        # what the kernel holds.
        applied = self.injector.apply(self.entry)
        return {"configured": self.injector.describe(), **applied}

    def __exit__(self, *exc: object) -> None:
        self.reverted = self.injector.revert()
        self.entry.done()
        for ns, dev in ((self.client_ns, self.topo.host_ifname),
                        (self.topo.netns, self.topo.target_ifname)):
            assert "535" not in tc(ns, "qdisc", "show", "dev", dev)
            assert tc(ns, "filter", "show", "dev", dev).strip() == ""


def shift_ok(before: list[float], after: list[float], expected_ms: float, tol: float,
             lowest: bool = False) -> bool:
    """Medians: one UML scheduling hiccup of a few ms must not decide the test. ``lowest``, for
    a delay without jitter: the lowest of each instead. netem holds every packet exactly that
    long, and a busy host only ever adds to it (UML's timers fire late): a 40 ms delay read
    41-53 ms, median 47.3, in a fresh clone's quiet tier beside the other quiet tests, its
    lowest 40.7 against a baseline's 0.13."""
    pick = min if lowest else statistics.median
    shift = pick(after) - pick(before)
    return abs(shift - expected_ms) <= tol * expected_ms


# ---------------------------------------------------------------------------- tests


@pytest.mark.timeout(60)
def test_delay_shifts_connect_and_ttfb_by_the_delay(topo: NamespaceTopology,
                                                    client_ns: str, serve: Serve) -> None:
    port = serve(topo.netns, topo.target_addr, http_like)
    base_connect = connect_ms(client_ns, topo.target_addr, port, 8)
    base_ttfb = warm_ttfb_ms(client_ns, topo.target_addr, port, 8)
    with Applied(topo, client_ns, port, {"delay": "50ms", "jitter": "10ms"}, mode="namespace"):
        # Toward the target only: the SYN waits 50 +- 10 ms, and so does each request.
        connect = connect_ms(client_ns, topo.target_addr, port, 15)
        ttfb = warm_ttfb_ms(client_ns, topo.target_addr, port, 15)
    assert shift_ok(base_connect, connect, 50, 0.15), (base_connect, connect)
    assert shift_ok(base_ttfb, ttfb, 50, 0.15), (base_ttfb, ttfb)
    # Reverted: back to the baseline measured above, not half the delay over it.
    after = connect_ms(client_ns, topo.target_addr, port, 5)
    assert statistics.median(after) < statistics.median(base_connect) + 50 / 2, \
        (base_connect, after)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["namespace", "host"])
def test_both_directions_delay_each_way(topo: NamespaceTopology, client_ns: str, serve: Serve,
                                        mode: str) -> None:
    # namespace: both veth ends; host: our egress plus an ifb for what comes back.
    port = serve(topo.netns, topo.target_addr, http_like)
    base = connect_ms(client_ns, topo.target_addr, port, 5)
    with Applied(topo, client_ns, port, {"delay": "30ms"}, mode=mode, direction="both") as a:
        connect = connect_ms(client_ns, topo.target_addr, port, 8)
    assert shift_ok(base, connect, 60, 0.15, lowest=True), (base, connect)
    assert [bool(h.get("ifb")) for h in a["kernel"]] == [False, mode == "host"]


@pytest.mark.timeout(60)
def test_netem_is_scoped_to_the_target_port_by_htb_and_u32(topo: NamespaceTopology,
                                                          client_ns: str, serve: Serve) -> None:
    shaped = serve(topo.netns, topo.target_addr, http_like)
    other = serve(topo.netns, topo.target_addr, http_like)  # an operator's SSH, say
    base_slow = connect_ms(client_ns, topo.target_addr, shaped, 6)
    base_fast = connect_ms(client_ns, topo.target_addr, other, 6)
    with Applied(topo, client_ns, shaped, {"delay": "40ms"}, mode="namespace") as applied:
        slow = connect_ms(client_ns, topo.target_addr, shaped, 6)
        fast = connect_ms(client_ns, topo.target_addr, other, 6)
        qdiscs = tc(client_ns, "-s", "qdisc", "show", "dev", topo.host_ifname)
        filters = tc(client_ns, "filter", "show", "dev", topo.host_ifname)
    # Against the same connects before the fault (UML on a busy host is slow at both alike):
    # the target port's shifted by the delay, the other's not by half of it.
    assert shift_ok(base_slow, slow, 40, 0.15, lowest=True), (base_slow, slow)
    assert statistics.median(fast) < statistics.median(base_fast) + 40 / 2, (base_fast, fast)
    assert "qdisc htb 5351: root" in qdiscs and "qdisc netem 5352: parent 5351:10" in qdiscs
    assert "delay 40ms" in qdiscs
    assert "flowid 5351:10" in filters and f"{shaped:04x}0000/ffff0000 at 22" in filters
    (hop,) = applied["kernel"]
    netem = next(q for q in hop["qdiscs"] if q["kind"] == "netem")
    assert netem["options"]["delay_ns"] == 40_000_000
    assert netem["stats"]["packets"] == 0  # read back before any traffic


@pytest.mark.timeout(60)
def test_loss_shows_up_as_retransmission_tails(topo: NamespaceTopology, client_ns: str,
                                               serve: Serve) -> None:
    port = serve(topo.netns, topo.target_addr, echo)

    def exchanges(n: int) -> list[float]:
        with tcp_socket(client_ns) as c:
            c.connect((topo.target_addr, port))
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.sendall(b"q" * 100)
                got = 0
                while got < 100:
                    got += len(c.recv(4096))
                out.append((time.perf_counter() - t0) * 1000)
        return out

    def retransmitted() -> int:
        snmp = subprocess.run(["ip", "netns", "exec", client_ns, "cat", "/proc/net/snmp"],
                              check=True, capture_output=True, text=True).stdout
        names, values = (ln.split() for ln in snmp.splitlines() if ln.startswith("Tcp:"))
        return int(dict(zip(names, values, strict=True))["RetransSegs"])

    base = exchanges(100)
    before = retransmitted()
    with Applied(topo, client_ns, port, {"loss": "10%"}, mode="namespace"):
        lossy = exchanges(150)
    retrans = retransmitted() - before
    # A lost request waits for the retransmission timer (200 ms minimum): a tail, not a shift
    # (the median moves from that of the same exchanges without loss, measured above, by less
    # than a quarter of that timer). Without loss, no such tail (a stall or two of a busy
    # host aside).
    tail = [x for x in lossy if x > 150]
    assert sum(x > 150 for x in base) <= 0.02 * len(base), sorted(base)[-5:]
    assert statistics.median(lossy) < statistics.median(base) + 200 / 4, \
        (statistics.median(base), statistics.median(lossy))
    assert 0.04 * len(lossy) <= len(tail) <= 0.20 * len(lossy), sorted(lossy)[-25:]
    assert retrans >= len(tail) * 0.8, (retrans, len(tail))


@pytest.mark.timeout(90)
def test_distribution_normal_is_applied_and_read_back(topo: NamespaceTopology,
                                                      client_ns: str, serve: Serve) -> None:
    port = serve(topo.netns, topo.target_addr, http_like)
    # What a connect takes here without a fault, and how much more its slower tenth takes:
    # measured now, as UML on a busy host makes them.
    base = sorted(connect_ms(client_ns, topo.target_addr, port, 20))
    floor, spread = statistics.median(base), base[17] - statistics.median(base)

    def outside_share(fields: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        with Applied(topo, client_ns, port, fields, mode="namespace") as applied:
            samples = [x - floor for x in connect_ms(client_ns, topo.target_addr, port, 120)]
        # Uniform jitter keeps every SYN within 40 +- 10 ms; a normal one (sigma 10 ms) does not.
        return sum(x < 30 or x > 51.5 + spread for x in samples) / len(samples), applied

    uniform, _ = outside_share({"delay": "40ms", "jitter": "10ms"})
    normal, applied = outside_share({"delay": "40ms", "jitter": "10ms",
                                     "distribution": "normal"})
    # N(40, 10) puts about 28% outside 30-51.5 ms, less as the busy host's spread widens the
    # window (13% seen under scripts/test-stress); a table left out keeps it near uniform's.
    assert uniform <= 0.07, uniform
    assert normal >= max(0.10, uniform + 0.05), (normal, uniform)
    table = load_table("normal")
    sent = hashlib.sha256(b"".join(v.to_bytes(2, "little", signed=True) for v in table))
    assert applied["configured"]["distribution"] == "normal"
    assert applied["configured"]["distribution_table_sha256"] == sent.hexdigest()
    netem = next(q for q in applied["kernel"][0]["qdiscs"] if q["kind"] == "netem")
    assert (netem["options"]["delay_ns"], netem["options"]["jitter_ns"]) == (40e6, 10e6)


@pytest.mark.timeout(60)
def test_netem_rate_limits_throughput(topo: NamespaceTopology, client_ns: str,
                                      serve: Serve) -> None:
    port = serve(topo.netns, topo.target_addr, sink)

    def upload(n: int) -> float:
        with tcp_socket(client_ns) as c:
            c.connect((topo.target_addr, port))
            c.sendall(b"x" * n)
            c.shutdown(socket.SHUT_WR)
            return float(c.recv(100))

    with Applied(topo, client_ns, port, {"rate": "8mbit"}, mode="namespace") as applied:
        rate = upload(1_000_000)
    assert abs(rate - 1_000_000) <= 0.15 * 1_000_000, f"{rate * 8 / 1e6:.2f} mbit/s"
    netem = next(q for q in applied["kernel"][0]["qdiscs"] if q["kind"] == "netem")
    assert netem["options"]["rate_bytes_per_s"] == 1_000_000


@pytest.mark.timeout(60)
def test_every_parameter_reaches_the_kernel(topo: NamespaceTopology, client_ns: str) -> None:
    fields = {"delay": "100ms", "jitter": "30ms", "correlation": "25%",
              "distribution": "paretonormal", "loss": "1.5%", "loss_correlation": "10%",
              "duplicate": "1%", "corrupt": "0.1%", "reorder": "5%", "gap": 3, "rate": "8mbit"}
    with Applied(topo, client_ns, 80, fields, mode="namespace") as applied:
        shown = tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)
    # `tc` itself, reading the kernel, agrees with our own read-back.
    assert ("delay 100ms  30ms 25% loss 1.5% 10% duplicate 1% reorder 5% corrupt 0.1% "
            "rate 8Mbit gap 3") in shown
    netem = next(q for q in applied["kernel"][0]["qdiscs"] if q["kind"] == "netem")["options"]
    assert netem["loss"] == round(0.015 * 0xFFFFFFFF) and netem["gap"] == 3
    assert applied["apply_ms"] > 0


@pytest.mark.timeout(90)
def test_same_az_profile_gives_its_ttfb(topo: NamespaceTopology, client_ns: str,
                                        serve: Serve) -> None:
    port = serve(topo.netns, topo.target_addr, http_like)

    def eight_clients(n: int) -> list[float]:
        samples: list[float] = []

        def client() -> None:
            samples.extend(warm_ttfb_ms(client_ns, topo.target_addr, port, n))

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return samples

    base = eight_clients(10)          # the same clients without the profile, measured now
    with Applied(topo, client_ns, port, {"profile": "same-az"}, mode="namespace"):
        samples = eight_clients(40)
    assert len(samples) == 320
    # The profile's claim: TTFB median ~82 ms and P95 ~290 ms, over what the same clients take
    # here without it (UML on a busy host adds to both). The P95 of 320 draws from a long
    # tail wobbles by tens of ms, so check the share of samples under 290 ms instead (binomial
    # sd 1.2%). Scheduling only adds delay, so the low side gets 4 sd (0.9125 was seen once in
    # CI); cross-region, the other profile, would be near 0.6.
    assert shift_ok(base, samples, 82, 0.15), (statistics.median(base), statistics.median(samples))
    under = sum(x <= 290 + statistics.median(base) for x in samples) / len(samples)
    assert 0.90 <= under <= 0.985, (under, sorted(samples)[-30:])


@pytest.mark.timeout(90)
def test_embedded_target_in_its_namespace_sees_the_delay(topo: NamespaceTopology,
                                                        client_ns: str) -> None:
    # The real embedded target, started inside the topology's namespace through cmd_prefix.
    from streamquake.embedded.config import TargetConfig
    from streamquake.embedded.process import start_target

    def first_byte_ms(port: int, n: int) -> list[float]:
        out = []
        for _ in range(n):
            with tcp_socket(client_ns) as s:
                s.connect((topo.target_addr, port))
                t0 = time.perf_counter()
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                assert s.recv(12).startswith(b"HTTP/1.1 200")
                out.append((time.perf_counter() - t0) * 1000)
                while s.recv(4096):
                    pass
        return out

    # This process lives outside the topology, so the health check runs from the client side.
    with start_target(TargetConfig(), host=topo.target_addr, cmd_prefix=topo.cmd_prefix(),
                      health_check=False, ready_timeout_s=60) as target:
        port = int(target.url.rsplit(":", 1)[1])
        assert target.url == f"http://{topo.target_addr}:{port}"
        base = first_byte_ms(port, 6)
        with Applied(topo, client_ns, port, {"delay": "40ms"}, mode="namespace"):
            delayed = first_byte_ms(port, 8)
    assert shift_ok(base, delayed, 40, 0.15, lowest=True), (base, delayed)


@pytest.mark.timeout(60)
def test_network_profile_stays_under_later_faults(topo: NamespaceTopology,
                                                  client_ns: str) -> None:
    net = NetworkConfig(mode="namespace", profile="cross-region")
    ctx = RunContext(topo.target_addr, 8080, Path("/tmp"), target_netns=topo.netns,
                     client_netns=client_ns, network=net)
    profile_fault = network_profile_fault(net)
    assert profile_fault is not None
    profile = NetemInjector(profile_fault, ctx)
    on_top = NetemInjector(NetemFault.model_validate({"delay": "100ms", "jitter": "30ms"}), ctx)
    limit = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}), ctx)
    applied = [inj.apply(Journal().add(inj.type_name, "stack"))
               for inj in (profile, on_top, limit)]

    def leaves(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        return [(q["kind"], q["parent"], q.get("options", {}))
                for q in result["kernel"][0]["qdiscs"] if q["kind"] != "htb"]

    (_, _, base), = leaves(applied[0])
    (_, _, both), = leaves(applied[1])
    assert both["delay_ns"] == base["delay_ns"] + 100_000_000  # delays add
    assert both["jitter_ns"] == round(math.hypot(base["jitter_ns"], 30e6))
    (tbf, tbf_parent, _), (netem, netem_parent, under) = leaves(applied[2])
    assert (tbf, netem) == ("tbf", "netem") and tbf_parent.startswith("5351:")
    assert netem_parent.endswith(":1") and under["delay_ns"] == base["delay_ns"]
    prefs = [a["hops"][0]["prefs"][0] for a in applied]
    assert prefs == sorted(prefs, reverse=True)  # the newest is matched first
    limit.revert()
    on_top.revert()
    left = tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)
    assert left.count("qdisc netem") == 1 and "qdisc tbf" not in left
    profile.revert()
    assert "535" not in tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)
