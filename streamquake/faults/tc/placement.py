"""Where a tc fault lands: the interfaces (and namespaces) that carry the target's packets, and
the u32 selectors that pick those packets out. Read-only: nothing here changes the kernel."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pyroute2 import IPRoute

from streamquake.errors import InjectorError
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.netlink import MATCH_ALL, link_index
from streamquake.faults.tc.netns import iproute
from streamquake.faults.tc.spec import TcPlacement

_ETH_P_IP, _ETH_P_IPV6 = 0x0800, 0x86DD
_RTN_LOCAL = 2

Match = Literal["to_target", "from_target", "all"]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Placement:
    interface: str | None
    scope: str
    direction: str


@dataclass(frozen=True)
class Hop:
    """One place we shape: packets leaving ``ifname`` in ``netns`` (or arriving, ``via_ifb``)."""

    netns: str | None
    ifname: str
    match: Match
    via_ifb: bool = False


def resolve_placement(spec: TcPlacement, ctx: RunContext) -> Placement:
    net = ctx.network       # None: the section's defaults (no interface, target, egress)
    return Placement(interface=spec.interface or (net.interface if net else None),
                     scope=spec.scope or (net.scope if net else "target"),
                     direction=spec.direction or (net.direction if net else "egress"))


def resolve_addresses(host: str) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InjectorError(
            f"cannot resolve the target host {host!r} to scope the tc fault: {exc}") from exc
    return sorted({ipaddress.ip_address(i[4][0]) for i in infos}, key=str)


def u32_selectors(addrs: Sequence[Address], port: int,
                  match: Match) -> list[tuple[int, list[str]]]:
    """(ethertype, u32 keys as pyroute2's 'val/mask+offset') for each target address."""
    if match == "all":
        return [MATCH_ALL]
    to_target = match == "to_target"
    out = []
    for addr in addrs:
        raw = addr.packed
        if addr.version == 4:
            proto, addr_off, port_off = _ETH_P_IP, (16 if to_target else 12), 20
        else:
            proto, addr_off, port_off = _ETH_P_IPV6, (24 if to_target else 8), 40
        keys = [f"0x{int.from_bytes(raw[i:i + 4], 'big'):08x}/0xffffffff+{addr_off + i}"
                for i in range(0, len(raw), 4)]
        keys.append(f"0x{port:08x}/0x0000ffff+{port_off}" if to_target
                    else f"0x{port << 16:08x}/0xffff0000+{port_off}")
        out.append((proto, keys))
    return out


def _route(ipr: IPRoute, dst: str) -> tuple[str, str | None, bool]:
    """(output interface, preferred source address, is the destination local) for ``dst``."""
    msg = ipr.route("get", dst=dst)[0]
    ifname = ipr.get_links(msg.get_attr("RTA_OIF"))[0].get_attr("IFLA_IFNAME")
    return ifname, msg.get_attr("RTA_PREFSRC"), msg["type"] == _RTN_LOCAL


def plan_hops(ctx: RunContext, placement: Placement) -> list[Hop]:
    """The interfaces (and namespaces) that carry the target's packets, one Hop per direction.

    ``ctx.client_netns`` names the load generator's namespace (default: ours).
    """
    client_ns = ctx.client_netns
    addr = str(resolve_addresses(ctx.target_host)[0])
    whole = placement.scope == "interface"
    with iproute(client_ns) as ipr:
        route_dev, prefsrc, local = _route(ipr, addr)
        dev = placement.interface or route_dev
        link_index(ipr, client_ns, dev)
    hops = [Hop(client_ns, dev, "all" if whole else "to_target")]
    back: Match = "all" if whole else "from_target"
    if placement.direction != "both":
        return hops
    if ctx.target_netns:
        with iproute(ctx.target_netns) as nsr:
            back_dev, _, _ = _route(nsr, prefsrc or addr)
        hops.append(Hop(ctx.target_netns, back_dev, back))
    elif local or dev == "lo":
        if not whole:  # loopback egress carries both directions: "all" already covers them
            hops.append(Hop(client_ns, dev, back))
    else:
        hops.append(Hop(client_ns, dev, back, via_ifb=True))
    return hops
