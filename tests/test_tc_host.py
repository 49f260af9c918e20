"""tbf/htb/u32 scoping, ownership, revert and recovery on this machine's own kernel.

Everything happens in network namespaces the tests create: a "client" namespace stands in for
the load generator's, and NamespaceTopology puts the target in another behind a veth pair.
Real TCP servers and clients measure what the kernel does; `tc` cross-checks what is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError
from pyroute2 import netns as pr_netns

from streamquake.errors import InjectorError
from streamquake.faults.catalog import fault_type
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.netem import NetemFault, NetemInjector, kernel_options
from streamquake.faults.tc.netns import TOPOLOGY_JOURNAL_TYPE, NamespaceTopology
from streamquake.faults.tc.probe import NO_NETEM, kernel_features
from streamquake.faults.tc.profiles import PROFILES
from streamquake.faults.tc.tbf import TbfFault, TbfInjector
from streamquake.journal import Journal
from streamquake.scenario.network import NetworkConfig
from tests.netns_fixtures import Serve, tcp_socket

REPO = Path(__file__).resolve().parents[1]
ONE_MBIT = 125_000  # bytes/s
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


# ---------------------------------------------------------------------------- tools


def sink(conn: socket.socket) -> None:
    """Read to EOF; answer with how fast the bytes after the first read came in."""
    first, total, t0, t1 = 0, 0, 0.0, 0.0
    while chunk := conn.recv(65536):
        now = time.perf_counter()
        if not total:
            first, t0 = len(chunk), now
        total, t1 = total + len(chunk), now
    conn.sendall(json.dumps({"rate": (total - first) / max(t1 - t0, 1e-9)}).encode())


def source(conn: socket.socket) -> None:
    """Send as many bytes as the client asks for (8-byte big-endian count)."""
    n = int.from_bytes(conn.recv(8), "big")
    conn.sendall(b"y" * n)


def upload_rate(ns: str, addr: str, port: int, n: int) -> float:
    with tcp_socket(ns) as c:
        c.connect((addr, port))
        c.sendall(b"x" * n)
        c.shutdown(socket.SHUT_WR)
        return float(json.loads(c.recv(1000))["rate"])


def download_rate(ns: str, addr: str, port: int, n: int) -> float:
    with tcp_socket(ns) as c:
        c.connect((addr, port))
        c.sendall(n.to_bytes(8, "big"))
        got, t0, t1, first = 0, 0.0, 0.0, 0
        while chunk := c.recv(65536):
            now = time.perf_counter()
            if not got:
                first, t0 = len(chunk), now
            got, t1 = got + len(chunk), now
        return (got - first) / max(t1 - t0, 1e-9)


def tc(ns: str | None, *args: str) -> str:
    cmd = ["tc"] + (["-n", ns] if ns else []) + list(args)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def links(ns: str) -> str:
    return subprocess.run(["ip", "-n", ns, "-o", "link"], check=True, capture_output=True,
                          text=True).stdout


def ours_left(ns: str, ifname: str) -> list[str]:
    """Anything of ours on ``ifname`` per `tc`/`ip` themselves (not our own read-back)."""
    left = [ln for ln in tc(ns, "qdisc", "show", "dev", ifname).splitlines()
            if " 535" in ln or "ingress" in ln]
    left += [ln for ln in tc(ns, "filter", "show", "dev", ifname).splitlines() if ln.strip()]
    left += [ln for ln in tc(ns, "filter", "show", "dev", ifname, "ingress").splitlines()
             if ln.strip()]
    left += [ln for ln in links(ns).splitlines() if "sqifb" in ln]
    return left


def ctx_for(topo: NamespaceTopology, client_ns: str, port: int, **network: object) -> RunContext:
    net = NetworkConfig(**network)  # type: ignore[arg-type]
    return RunContext(topo.target_addr, port, Path("/tmp"),
                      target_netns=topo.netns if net.mode == "namespace" else None,
                      client_netns=client_ns, network=net)


def within(measured: float, expected: float, tolerance: float) -> bool:
    return abs(measured - expected) <= tolerance * expected


# ---------------------------------------------------------------------------- parameters


@pytest.mark.timeout(10)
def test_netem_parameters_as_people_write_them() -> None:
    f = NetemFault.model_validate({
        "type": "netem", "delay": "100ms", "jitter": "30ms", "correlation": "25%",
        "distribution": "normal", "loss": "1.5%", "loss_correlation": "10%",
        "duplicate": "1%", "corrupt": "0.1%", "reorder": "5%", "gap": 3, "rate": "8mbit",
    })
    assert (f.delay_ms, f.jitter_ms, f.correlation) == (100.0, 30.0, 0.25)
    assert (f.loss, f.rate_bytes_per_s, f.gap) == (0.015, 1_000_000.0, 3)
    opts = kernel_options(f, table=[0, 1, -1])
    attrs = dict(opts["attrs"])
    assert attrs["TCA_NETEM_LATENCY64"] == 100_000_000 and attrs["TCA_NETEM_JITTER64"] == 30_000_000
    assert opts["loss"] == round(0.015 * 0xFFFFFFFF)
    assert attrs["TCA_NETEM_RATE"]["rate"] == 1_000_000
    assert attrs["TCA_NETEM_DELAY_DIST"] == b"\x00\x00\x01\x00\xff\xff"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("fields", "says"), [
    ({"delay": "10ms", "jitter": "5ms", "distribution": "uniform"}, "already uniform"),
    ({"delay": "10ms", "distribution": "normal"}, "needs `jitter` > 0"),
    ({"loss": "1%", "loss_correlation": "1%", "reorder": "5%"}, "needs `delay` > 0"),
    ({"delay": "10ms", "loss_correlation": "5%"}, "needs `loss` > 0"),
    ({"jitter": "0ms"}, "changes nothing"),
    ({"delay": "ten"}, "expected a duration"),
    ({"loss": "150%"}, "between 0% and 100%"),
    ({"rate": 8}, "give a unit"),
    ({"profile": "moon"}, "known profiles: cross-region, same-az"),
])
def test_netem_rejects_what_netem_cannot_do(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says.replace("`", ".").replace(">", ".")):
        NetemFault.model_validate({"type": "netem", **fields})


@pytest.mark.timeout(10)
def test_profiles_become_netem_parameters_and_faults_add_on_top() -> None:
    for p in PROFILES.values():
        f = NetemFault.model_validate({"type": "netem", "profile": p.name})
        assert f.distribution == "paretonormal"
        # The median and P95 of one delay sample are the profile's TTFB figures.
        assert round(f.delay_ms - 0.2405 * f.jitter_ms) == round(p.ttfb_median_ms)
        assert round(f.delay_ms + 1.6196 * f.jitter_ms) == round(p.ttfb_p95_ms)
    assert NetemFault.model_validate({"profile": "same-az", "delay": "5ms"}).delay_ms == 5.0
    ctx = RunContext("10.213.0.2", 80, Path("/tmp"),
                     network=NetworkConfig(profile="cross-region"))
    on_top = NetemInjector(NetemFault.model_validate({"delay": "100ms", "jitter": "30ms"}), ctx)
    base = NetemFault.model_validate({"profile": "cross-region"})
    assert on_top.effective.delay_ms == pytest.approx(base.delay_ms + 100)
    assert on_top.describe()["over_network_profile"] == "cross-region"
    with pytest.raises(ValidationError, match="mode: namespace"):
        NetworkConfig(mode="namespace", interface="eth0")


@pytest.mark.timeout(10)
def test_tbf_parameters() -> None:
    f = TbfFault.model_validate({"type": "tbf", "rate": "1mbit", "burst": "32kb",
                                 "latency": "40ms"})
    assert (f.rate_bytes_per_s, f.burst, f.latency_ms) == (ONE_MBIT, 32768, 40.0)
    with pytest.raises(ValidationError, match="full-size"):
        TbfFault.model_validate({"rate": "1mbit", "burst": 100})
    assert fault_type("tbf").injector() is TbfInjector
    assert fault_type("netem").injector() is NetemInjector


# ---------------------------------------------------------------------------- preflight


@needs_root
@pytest.mark.timeout(20)
def test_preflight_says_this_kernel_has_no_netem(topo: NamespaceTopology, client_ns: str) -> None:
    # Oracle independent of our probe: ask `tc` itself in a throwaway namespace.
    probe = f"sqtest-probe-{uuid.uuid4().hex[:6]}"
    pr_netns.create(probe)
    try:
        tc_has_netem = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True).returncode == 0
    finally:
        pr_netns.remove(probe)
    assert ("netem" in kernel_features()) == tc_has_netem
    ctx = ctx_for(topo, client_ns, 80, mode="namespace")
    netem_problems = NetemInjector(NetemFault.model_validate({"delay": "50ms"}), ctx).preflight()
    tbf_problems = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}), ctx).preflight()
    assert tbf_problems == []
    if tc_has_netem:
        assert netem_problems == []
    else:
        assert netem_problems == [NO_NETEM + ", which this kernel supports"]
        assert netem_problems[0].startswith(
            "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); ")


@needs_root
@pytest.mark.timeout(30)
def test_preflight_without_cap_net_admin_is_one_sentence() -> None:
    code = textwrap.dedent("""
        from pathlib import Path
        from streamquake.faults.contract import RunContext
        from streamquake.faults.tc.tbf import TbfFault, TbfInjector
        inj = TbfInjector(TbfFault(rate="1mbit"), RunContext("127.0.0.1", 80, Path("/tmp")))
        print(repr(inj.preflight()))
    """)
    out = subprocess.run(
        ["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=25, cwd=REPO)
    assert out.returncode == 0, out.stderr
    problems = eval(out.stdout)  # noqa: S307 - our own repr() of a list of str
    assert len(problems) == 1
    assert problems[0].startswith("changing traffic control needs CAP_NET_ADMIN")


# ---------------------------------------------------------------------------- shaping


@needs_root
@pytest.mark.timeout(30)
def test_tbf_limits_only_the_target_port(topo: NamespaceTopology, client_ns: str,
                                         serve: Serve) -> None:
    shaped = serve(topo.netns, topo.target_addr, sink)
    other = serve(topo.netns, topo.target_addr, sink)
    inj = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}),
                      ctx_for(topo, client_ns, shaped, mode="namespace"))
    entry = Journal().add("tbf", "limit")
    applied = inj.apply(entry)
    try:
        rate = upload_rate(client_ns, topo.target_addr, shaped, 250_000)
        free = upload_rate(client_ns, topo.target_addr, other, 2_000_000)
    finally:
        inj.revert()
        entry.done()
    assert within(rate, ONE_MBIT, 0.10), f"tbf 1mbit carried {rate * 8 / 1e6:.3f} mbit/s"
    assert free > 20 * ONE_MBIT, f"another port on the target got only {free * 8 / 1e6:.1f} mbit/s"
    (hop,) = applied["kernel"]
    assert {q["kind"] for q in hop["qdiscs"]} == {"htb", "tbf"}
    assert hop["filters"][0]["flowid"] == "5351:10"
    assert f"{shaped:04x}0000/ffff0000 at 22" in hop["filters"][0]["keys"]
    # Timed and reported; how long it takes, against a bare tc call, is a measurement in
    # benchmarks/tc_apply_revert.py, not a wall-clock bound here.
    assert applied["apply_ms"] > 0


@needs_root
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["namespace", "host"])
def test_tbf_both_directions_limits_the_answers(topo: NamespaceTopology, client_ns: str,
                                                serve: Serve, mode: str) -> None:
    # namespace: shaped where the answers leave the target's veth end; host: through an ifb.
    port = serve(topo.netns, topo.target_addr, source)
    inj = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}),
                      ctx_for(topo, client_ns, port, mode=mode, direction="both"))
    entry = Journal().add("tbf", "both")
    applied = inj.apply(entry)
    try:
        rate = download_rate(client_ns, topo.target_addr, port, 250_000)
    finally:
        inj.revert()
        entry.done()
    assert within(rate, ONE_MBIT, 0.10), f"answers came at {rate * 8 / 1e6:.3f} mbit/s"
    back = applied["kernel"][1]
    if mode == "host":
        assert back["ifb"].startswith("sqifb") and back["qdiscs"][0]["kind"] == "tbf"
        assert back["filters"][0]["action"]["kind"] == "mirred"
    else:
        assert back["netns"] == topo.netns and back["ifname"] == topo.target_ifname


# ---------------------------------------------------------------------------- ownership


@needs_root
@pytest.mark.timeout(20)
def test_refuses_a_root_qdisc_that_is_not_ours(topo: NamespaceTopology, client_ns: str) -> None:
    tc(client_ns, "qdisc", "add", "dev", topo.host_ifname, "root", "handle", "1:", "tbf",
       "rate", "5mbit", "burst", "10kb", "latency", "50ms")
    inj = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}),
                      ctx_for(topo, client_ns, 80, mode="namespace"))
    (problem,) = inj.preflight()
    assert "already has a root qdisc (tbf 1:) that streamquake did not install" in problem
    assert f"`tc -n {client_ns} qdisc del dev {topo.host_ifname} root`" in problem
    with pytest.raises(InjectorError, match="streamquake never replaces someone else's"):
        inj.apply(Journal().add("tbf", "refused"))
    assert "qdisc tbf 1: root" in tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)
    assert "5351" not in tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)


@needs_root
@pytest.mark.timeout(20)
def test_refuses_an_ingress_qdisc_that_is_not_ours(topo: NamespaceTopology,
                                                  client_ns: str) -> None:
    dev = topo.host_ifname
    tc(client_ns, "qdisc", "add", "dev", dev, "ingress")
    tc(client_ns, "filter", "add", "dev", dev, "parent", "ffff:", "pref", "7", "protocol", "ip",
       "u32", "match", "u32", "0", "0", "flowid", "1:1")
    inj = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}),
                      ctx_for(topo, client_ns, 80, mode="host", direction="both"))
    with pytest.raises(InjectorError, match="ingress qdisc with filters that streamquake did not"):
        inj.apply(Journal().add("tbf", "refused"))
    assert "pref 7" in tc(client_ns, "filter", "show", "dev", dev, "ingress")
    # The egress part it had installed before refusing is gone again.
    assert "5351" not in tc(client_ns, "qdisc", "show", "dev", dev)


# ---------------------------------------------------------------------------- revert


@needs_root
@pytest.mark.timeout(20)
def test_revert_leaves_nothing_of_ours_and_is_idempotent(topo: NamespaceTopology,
                                                         client_ns: str) -> None:
    inj = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}),
                      ctx_for(topo, client_ns, 80, mode="host", direction="both"))
    entry = Journal().add("tbf", "revert")
    inj.apply(entry)
    (saved,) = [e["state"] for e in Journal().entries() if e["type"] == "tbf"]
    assert [h["ifname"] for h in saved["hops"]] == [topo.host_ifname] * 2
    assert saved["hops"][1]["ifb"].startswith("sqifb")
    assert ours_left(client_ns, topo.host_ifname)  # the check below can see something
    first = inj.revert()
    assert inj.revert()["removed"] == []
    entry.done()
    assert ours_left(client_ns, topo.host_ifname) == []
    assert any("ifb" in r for r in first["removed"]) and first["revert_ms"] > 0   # see above
    assert "noqueue 0: root" in tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)


@needs_root
@pytest.mark.timeout(20)
def test_two_faults_share_our_root_and_the_newest_wins(topo: NamespaceTopology,
                                                       client_ns: str) -> None:
    ctx = ctx_for(topo, client_ns, 80, mode="namespace")
    older = TbfInjector(TbfFault.model_validate({"rate": "5mbit"}), ctx)
    newer = TbfInjector(TbfFault.model_validate({"rate": "1mbit"}), ctx)
    older.apply(Journal().add("tbf", "older"))
    applied = newer.apply(Journal().add("tbf", "newer"))
    older_pref = older._tc.hop_states()[0].prefs[0]
    newer_pref = newer._tc.hop_states()[0].prefs[0]
    assert newer_pref < older_pref  # a lower pref is matched first
    assert applied["kernel"][0]["filters"][0]["flowid"] == "5351:11"
    older.revert()
    qdiscs_left = tc(client_ns, "qdisc", "show", "dev", topo.host_ifname)
    assert "htb 5351: root" in qdiscs_left and "rate 1Mbit" in qdiscs_left
    newer.revert()
    assert ours_left(client_ns, topo.host_ifname) == []


# ---------------------------------------------------------------------------- recovery


_APPLY_AND_WAIT = """
import sys, time
from pathlib import Path
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.tbf import TbfFault, TbfInjector
from streamquake.journal import Journal
from streamquake.faults.tc.netns import NamespaceTopology
from streamquake.scenario.network import NetworkConfig
client = sys.argv[1]
topo = NamespaceTopology(host_netns=client).create()
for mode in ("namespace", "host"):
    ctx = RunContext(topo.target_addr, 8080, Path("/tmp"),
                     target_netns=topo.netns if mode == "namespace" else None,
                     client_netns=client, network=NetworkConfig(mode=mode, direction="both"))
    TbfInjector(TbfFault(rate="1mbit"), ctx).apply(Journal().add("tbf", mode))
print("APPLIED", topo.netns, topo.host_ifname, flush=True)
time.sleep(60)
"""

_RECOVER = """
from streamquake.faults.catalog import recoverer
from streamquake.journal import Journal
from streamquake.faults.tc.netns import TOPOLOGY_JOURNAL_TYPE, NamespaceTopology
journal = Journal()
for e in reversed(journal.entries()):  # faults before the topology they live in
    if e["type"] == TOPOLOGY_JOURNAL_TYPE:
        print(NamespaceTopology.recover(e["state"]))
    else:
        print(recoverer(e["type"])(e["state"]))
    journal.remove(e["id"])
"""


@needs_root
@pytest.mark.timeout(60)
def test_recover_after_sigkill_leaves_nothing_of_ours(client_ns: str) -> None:
    target_ns = ""
    try:
        with subprocess.Popen([sys.executable, "-c", _APPLY_AND_WAIT, client_ns],
                              stdout=subprocess.PIPE, text=True, cwd=REPO) as applier:
            try:
                line = applier.stdout.readline() if applier.stdout else ""
                assert line.startswith("APPLIED"), f"the applying process said {line!r}"
                _, target_ns, host_if = line.split()
                assert ours_left(client_ns, host_if)
                assert any("sqifb" in ln for ln in links(client_ns).splitlines())
            finally:
                applier.send_signal(signal.SIGKILL)
                applier.wait(timeout=10)
        assert [e["type"] for e in Journal().entries()] == [TOPOLOGY_JOURNAL_TYPE, "tbf", "tbf"]
        out = subprocess.run([sys.executable, "-c", _RECOVER], capture_output=True, text=True,
                             timeout=30, cwd=REPO)
        assert out.returncode == 0, out.stderr
        said = out.stdout.splitlines()
        assert [ln.split(":")[0] for ln in said[:2]] == ["tbf fault", "tbf fault"], said
        assert "ifb sqifb" in said[0] and "class 5351:10" in said[1]
        assert said[2] == f"removed veth {host_if} and namespace {target_ns}"
        assert Journal().entries() == []
        assert target_ns not in pr_netns.listnetns()
        assert [ln for ln in links(client_ns).splitlines() if "sq" in ln] == []
        assert [ln for ln in tc(client_ns, "qdisc", "show").splitlines() if "535" in ln] == []
        # Recovering again finds nothing left to do.
        again = subprocess.run([sys.executable, "-c", _RECOVER], capture_output=True, text=True,
                               timeout=30, cwd=REPO)
        assert again.returncode == 0 and again.stdout == ""
    finally:
        if target_ns in pr_netns.listnetns():  # only when the test failed half-way
            pr_netns.remove(target_ns)


@needs_root
@pytest.mark.timeout(20)
def test_topology_is_removed_on_exceptions(client_ns: str) -> None:
    with pytest.raises(RuntimeError), NamespaceTopology(host_netns=client_ns) as t:
        name, host_if = t.netns, t.host_ifname
        assert name in pr_netns.listnetns()
        assert t.cmd_prefix() == ["ip", "netns", "exec", name]
        raise RuntimeError("boom")
    assert name not in pr_netns.listnetns()
    assert host_if not in links(client_ns)
    assert Journal().entries() == []
