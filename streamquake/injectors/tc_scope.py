"""Where a tc fault lands: the target's packets only, on the interfaces that carry them.

Shared by the netem and tbf injectors, which hand in the qdisc(s) to install ("leaves"). Every
change goes through rtnetlink (pyroute2), never through the ``tc`` program.

Layout on each interface we shape, in ``tc`` notation::

    qdisc htb 5351: root default 1                 our root: reserved handle 5351: ("SQ")
      class htb 5351:1   rate 100gbit              unshaped: everything unmatched (SSH...)
      class htb 5351:10  rate 100gbit              one shaped class per applied fault
        qdisc netem|tbf 5352: parent 5351:10       the fault (leaf handles 5352: to 53ff:)
      filter pref 21328 u32 match ip dst T/32 dport P  flowid 5351:10

u32 matches address and port only (TCP and UDP to the target's port are both its traffic) and
assumes a 20-byte IPv4 header, as ``tc ... match ip dport`` does. Filter prefs come from
0x5300-0x5350, each new fault taking one below the lowest in use: the newest fault on a path
sees its packets, and an older one (a whole-run network profile) takes over when it goes.

Where each direction is shaped: packets toward the target as they leave the load generator's
interface (the route to the target, or ``interface``). With ``direction: both``, the answers as
they leave the target's end of the veth pair (namespace mode), or leave ``lo`` (a local target),
or, for a remote target, as they arrive: an ``ingress`` qdisc whose u32 filter (at one of our
prefs) redirects them with mirred to an ifb device of ours, ``sqifb<id>``, rooted in the fault.

Ownership: a root qdisc with handle 0: is the kernel's default (ours to replace; the kernel
restores it when ours goes); 5351: htb is ours and shared; anything else is someone else's and
is never touched: apply refuses and says how to remove it. An ``ingress`` qdisc is used only
when every filter on it is ours. Revert removes exactly the filters, class, leaves and ifb it
made, then our root once no shaped class is left on it, and the ``ingress`` qdisc once no filter
is left on it.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import socket
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns
from pyroute2.netlink import NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import (
    RTM_DELTFILTER,
    RTM_GETQDISC,
    RTM_GETTCLASS,
    RTM_GETTFILTER,
    TC_H_INGRESS,
    TC_H_ROOT,
)
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from streamquake.errors import InjectorError, RevertError
from streamquake.injectors.base import RunContext
from streamquake.journal import JournalEntry
from streamquake.netns import (
    NetworkConfig,
    has_cap_net_admin,
    iproute,
    is_gone,
    netns_exists,
    run_with_deadline,
)

ROOT_MAJOR = 0x5351
ROOT_HANDLE = ROOT_MAJOR << 16
DEFAULT_CLASS = ROOT_HANDLE | 0x1
FIRST_SHAPED_MINOR = 0x10
LEAF_MAJORS = range(0x5352, 0x5400)
PREF_TOP, PREF_FLOOR = 0x5350, 0x5300
INGRESS_HANDLE = 0xFFFF0000
IFB_PREFIX = "sqifb"
# "Unshaped": far above what any interface here carries, so htb never holds a packet back.
UNSHAPED_BYTES_PER_S = 100_000_000_000 // 8
_HTB_QUANTUM = 60_000
_ETH_P_ALL, _ETH_P_IP, _ETH_P_IPV6 = 0x0003, 0x0800, 0x86DD
_RTN_LOCAL = 2
_EINVAL = 22
_MATCH_ALL = (_ETH_P_ALL, ["0x0/0x0+0"])

Match = Literal["to_target", "from_target", "all"]
Decoder = Callable[[Any], dict[str, Any]]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class TcPlacement(BaseModel):
    """Per-fault overrides of the scenario's ``network:`` section (None: take it from there)."""

    interface: str | None = None
    scope: Literal["target", "interface"] | None = None
    direction: Literal["egress", "both"] | None = None


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


@dataclass(frozen=True)
class LeafQdisc:
    """A qdisc the fault supplies: ``add(ipr, ifindex, parent, handle)`` installs it."""

    kind: str
    add: Callable[[IPRoute, int, int, int], None]


# ---------------------------------------------------------------------------- kernel access


def fmt_handle(h: int) -> str:
    if h == TC_H_ROOT:
        return "root"
    if h == TC_H_INGRESS:
        return "ingress"
    major, minor = h >> 16, h & 0xFFFF
    return f"{major:x}:{minor:x}" if minor else f"{major:x}:"


def _tc_request(ipr: IPRoute, msg_type: int, flags: int, index: int, parent: int = 0,
                info: int = 0) -> list[Any]:
    msg = tcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = index
    msg["parent"] = parent
    msg["info"] = info
    return [m for m in ipr.nlm_request(msg, msg_type, flags) if m.get("index") == index]


def qdiscs(ipr: IPRoute, index: int) -> list[Any]:
    return _tc_request(ipr, RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP, index)


def classes(ipr: IPRoute, index: int) -> list[Any]:
    return _tc_request(ipr, RTM_GETTCLASS, NLM_F_REQUEST | NLM_F_DUMP, index)


def filters(ipr: IPRoute, index: int, parent: int) -> list[Any]:
    return _tc_request(ipr, RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP, index, parent)


def _del_filters(ipr: IPRoute, index: int, parent: int, pref: int) -> None:
    """Delete every filter at ``pref`` under ``parent`` (any protocol, any handle)."""
    _tc_request(ipr, RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK, index, parent, pref << 16)


def _at(present: list[Any], parent: int) -> Any | None:
    return next((q for q in present if q["parent"] == parent), None)


def _pref(f: Any) -> int:
    return int(f["info"]) >> 16


def _ours(pref: int) -> bool:
    return PREF_FLOOR <= pref <= PREF_TOP


def _index(ipr: IPRoute, netns: str | None, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        where = f" in network namespace {netns}" if netns else ""
        raise InjectorError(f"interface {ifname!r} does not exist{where}; check network.interface")
    return int(found[0])


# ---------------------------------------------------------------------------- decoding


@functools.cache
def psched_ns_per_tick() -> int:
    try:
        with open("/proc/net/psched") as fh:
            return int(fh.read().split()[1], 16)
    except (OSError, IndexError, ValueError):
        return 64  # PSCHED_SHIFT 6, unchanged since Linux 2.6.31


def _decode_htb(msg: Any) -> dict[str, Any]:
    opts = msg.get_attr("TCA_OPTIONS")
    if opts is None:
        return {}
    init = opts.get_attr("TCA_HTB_INIT")
    if init is not None:
        return {"default": f"{init['defcls']:x}"}
    parms = opts.get_attr("TCA_HTB_PARMS") or {}
    return {"rate_bytes_per_s": opts.get_attr("TCA_HTB_RATE64") or parms.get("rate"),
            "ceil_bytes_per_s": opts.get_attr("TCA_HTB_CEIL64") or parms.get("ceil")}


def _decode_tbf(msg: Any) -> dict[str, Any]:
    opts = msg.get_attr("TCA_OPTIONS")
    parms = opts.get_attr("TCA_TBF_PARMS") if opts is not None else None
    if not parms:
        return {}
    rate = parms["rate"]
    # buffer is the time the bucket takes to fill, in psched ticks.
    burst = parms["buffer"] * psched_ns_per_tick() * rate / 1e9
    return {"rate_bytes_per_s": rate, "burst_bytes": round(burst), "limit_bytes": parms["limit"]}


_DECODERS: dict[str, Decoder] = {"htb": _decode_htb, "tbf": _decode_tbf}


def describe_qdisc(msg: Any, decoders: dict[str, Decoder]) -> dict[str, Any]:
    kind = msg.get_attr("TCA_KIND")
    view: dict[str, Any] = {"kind": kind, "handle": fmt_handle(msg["handle"]),
                            "parent": fmt_handle(msg["parent"])}
    decoder = decoders.get(kind) or _DECODERS.get(kind)
    if decoder is not None:
        view["options"] = decoder(msg)
    stats = msg.get_attr("TCA_STATS")
    if stats is not None:
        view["stats"] = {"bytes": stats["bytes"], "packets": stats["packets"],
                         "drops": stats["drop"]}
    return view


def _u32_keys(sel: Any) -> list[str]:
    """A dumped u32 selector's keys as ``tc filter show`` prints them ("val/mask at off").

    Read from the raw attribute: pyroute2 0.9.7 decodes the keys from the wrong offset.
    """
    raw = bytes(sel.data[sel.offset + 4: sel.offset + sel.length])
    keys = []
    for i in range(raw[2]):  # nkeys; each tc_u32_key is 16 bytes after the 16-byte selector
        mask, val = struct.unpack_from(">II", raw, 16 + 16 * i)
        (off,) = struct.unpack_from("=i", raw, 16 + 16 * i + 8)
        keys.append(f"{val:08x}/{mask:08x} at {off}")
    return keys


def describe_filter(msg: Any) -> dict[str, Any]:
    opts = msg.get_attr("TCA_OPTIONS")
    view: dict[str, Any] = {"kind": msg.get_attr("TCA_KIND"), "pref": _pref(msg),
                            "protocol": f"{socket.ntohs(int(msg['info']) & 0xFFFF):#06x}",
                            "parent": fmt_handle(msg["parent"])}
    classid = opts.get_attr("TCA_U32_CLASSID")
    if classid:
        view["flowid"] = fmt_handle(classid)
    view["keys"] = _u32_keys(opts.get_attr("TCA_U32_SEL"))
    act = opts.get_attr("TCA_U32_ACT")
    for _, action in (act or {}).get("attrs", []):
        if action.get_attr("TCA_ACT_KIND") == "mirred":
            parms = action.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
            view["action"] = {"kind": "mirred", "eaction": parms["eaction"],
                              "ifindex": parms["ifindex"]}
    return view


def _u32_nodes(ipr: IPRoute, index: int, parent: int, prefs: Sequence[int]) -> list[Any]:
    """The match nodes (not the hash-table headers) of our u32 filters at ``prefs``."""
    return [f for f in filters(ipr, index, parent)
            if _pref(f) in prefs and f.get_attr("TCA_OPTIONS") is not None
            and f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_SEL") is not None]


# ---------------------------------------------------------------------------- planning


def resolve_placement(spec: TcPlacement, ctx: RunContext) -> Placement:
    net = ctx.extra.get("network")
    if isinstance(net, dict):
        net = NetworkConfig.model_validate(net)
    if net is None:
        net = NetworkConfig(mode="namespace" if ctx.target_netns else "host")
    return Placement(interface=spec.interface or net.interface, scope=spec.scope or net.scope,
                     direction=spec.direction or net.direction)


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


def _u32_selectors(addrs: Sequence[Address], port: int,
                   match: Match) -> list[tuple[int, list[str]]]:
    """(ethertype, u32 keys as pyroute2's 'val/mask+offset') for each target address."""
    if match == "all":
        return [_MATCH_ALL]
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

    ``ctx.extra["client_netns"]`` names the load generator's namespace (default: ours).
    """
    client_ns = ctx.extra.get("client_netns")
    addr = str(resolve_addresses(ctx.target_host)[0])
    whole = placement.scope == "interface"
    with iproute(client_ns) as ipr:
        route_dev, prefsrc, local = _route(ipr, addr)
        dev = placement.interface or route_dev
        _index(ipr, client_ns, dev)
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


# ---------------------------------------------------------------------------- ownership


def _foreign_root(present: list[Any], hop: Hop) -> str | None:
    root = _at(present, TC_H_ROOT)
    if root is None or root["handle"] == 0 or (
            root["handle"] == ROOT_HANDLE and root.get_attr("TCA_KIND") == "htb"):
        return None
    where = f" -n {hop.netns}" if hop.netns else ""
    return (
        f"interface {hop.ifname} already has a root qdisc ({root.get_attr('TCA_KIND')} "
        f"{fmt_handle(root['handle'])}) that streamquake did not install, and streamquake never "
        f"replaces someone else's; if it is no longer needed remove it with "
        f"`tc{where} qdisc del dev {hop.ifname} root`, or shape another interface"
    )


def _foreign_ingress(ipr: IPRoute, index: int, present: list[Any], hop: Hop) -> str | None:
    ingress = _at(present, TC_H_INGRESS)
    if ingress is None:
        return None
    kind = ingress.get_attr("TCA_KIND")
    if kind == "ingress" and all(_ours(_pref(f)) for f in filters(ipr, index, INGRESS_HANDLE)):
        return None
    where = f" -n {hop.netns}" if hop.netns else ""
    return (
        f"interface {hop.ifname} already has an {kind} qdisc with filters that streamquake did "
        f"not install, and shaping the target's answers would need it; remove it with "
        f"`tc{where} qdisc del dev {hop.ifname} {kind}`, or use direction: egress"
    )


def _ownership_problem(ipr: IPRoute, hop: Hop) -> str | None:
    index = _index(ipr, hop.netns, hop.ifname)
    present = qdiscs(ipr, index)
    if hop.via_ifb:
        return _foreign_ingress(ipr, index, present, hop)
    return _foreign_root(present, hop)


# ---------------------------------------------------------------------------- install


def _free(candidates: Sequence[int], used: set[int], n: int, what: str) -> list[int]:
    free = [c for c in candidates if c not in used][:n]
    if len(free) < n:
        raise InjectorError(f"no free {what} left in streamquake's reserved range; revert or "
                            "recover earlier faults first")
    return free


def _new_prefs(in_use: set[int], n: int) -> list[int]:
    ours = [p for p in in_use if _ours(p)]
    top = min(ours) - 1 if ours else PREF_TOP
    if top - n + 1 < PREF_FLOOR:
        raise InjectorError("too many streamquake filters on one interface; revert some faults")
    return list(range(top, top - n, -1))


def _add_filters(ipr: IPRoute, index: int, parent: int, prefs: list[int],
                 selectors: list[tuple[int, list[str]]], **extra: Any) -> None:
    for pref, (proto, keys) in zip(prefs, selectors, strict=True):
        ipr.tc("add-filter", "u32", index=index, parent=parent, prio=pref, protocol=proto,
               keys=keys, **extra)


def _add_unshaped_class(ipr: IPRoute, index: int, classid: int) -> None:
    ipr.tc("add-class", "htb", index=index, handle=classid, parent=ROOT_HANDLE,
           rate=UNSHAPED_BYTES_PER_S, ceil=UNSHAPED_BYTES_PER_S, quantum=_HTB_QUANTUM)


def _add_chain(ipr: IPRoute, index: int, parent: int, leaves: Sequence[LeafQdisc],
               majors: list[int]) -> None:
    for leaf, major in zip(leaves, majors, strict=True):
        leaf.add(ipr, index, parent, major << 16)
        parent = (major << 16) | 1  # the next leaf hangs under this one's single class


def _install_htb(ipr: IPRoute, hop: Hop, st: dict[str, Any], leaves: Sequence[LeafQdisc],
                 selectors: list[tuple[int, list[str]]], save: Callable[[], None]) -> None:
    index = _index(ipr, hop.netns, hop.ifname)
    present = qdiscs(ipr, index)
    problem = _foreign_root(present, hop)
    if problem:
        raise InjectorError(problem)
    root = _at(present, TC_H_ROOT)
    ours = root is not None and root["handle"] == ROOT_HANDLE
    minors = {c["handle"] & 0xFFFF for c in classes(ipr, index)} if ours else set()
    st["class_minor"] = _free(range(FIRST_SHAPED_MINOR, 0xFFFF), minors, 1, "class id")[0]
    st["leaf_majors"] = _free(LEAF_MAJORS, {q["handle"] >> 16 for q in present}, len(leaves),
                              "qdisc handle")
    st["prefs"] = _new_prefs({_pref(f) for f in filters(ipr, index, ROOT_HANDLE)} if ours
                             else set(), len(selectors))
    save()  # all that recover needs is on disk before the first change
    if not ours:
        ipr.tc("add", "htb", index=index, handle=ROOT_HANDLE, parent=TC_H_ROOT, default=1)
    if 1 not in minors:
        _add_unshaped_class(ipr, index, DEFAULT_CLASS)
    classid = ROOT_HANDLE | st["class_minor"]
    _add_unshaped_class(ipr, index, classid)
    _add_chain(ipr, index, classid, leaves, st["leaf_majors"])
    _add_filters(ipr, index, ROOT_HANDLE, st["prefs"], selectors, target=classid)


def _install_ifb(ipr: IPRoute, hop: Hop, st: dict[str, Any], leaves: Sequence[LeafQdisc],
                 selectors: list[tuple[int, list[str]]], save: Callable[[], None]) -> None:
    index = _index(ipr, hop.netns, hop.ifname)
    present = qdiscs(ipr, index)
    problem = _foreign_ingress(ipr, index, present, hop)
    if problem:
        raise InjectorError(problem)
    in_use = {_pref(f) for f in filters(ipr, index, INGRESS_HANDLE)}
    has_ingress = _at(present, TC_H_INGRESS) is not None
    # An ingress qdisc we create, or one whose filters are all ours, is ours to remove later.
    st["ingress_owned"] = not has_ingress or bool(in_use)
    st["ifb"] = f"{IFB_PREFIX}{uuid.uuid4().hex[:8]}"
    st["leaf_majors"] = list(LEAF_MAJORS[: len(leaves)])
    st["ingress_prefs"] = _new_prefs(in_use, len(selectors))
    save()
    ipr.link("add", ifname=st["ifb"], kind="ifb")
    ifb = ipr.link_lookup(ifname=st["ifb"])[0]
    ipr.link("set", index=ifb, state="up")
    _add_chain(ipr, ifb, TC_H_ROOT, leaves, st["leaf_majors"])
    if not has_ingress:
        ipr.tc("add", "ingress", index=index, handle=INGRESS_HANDLE)
    _add_filters(ipr, index, INGRESS_HANDLE, st["ingress_prefs"], selectors, target=0,
                 action={"kind": "mirred", "direction": "egress", "action": "redirect",
                         "ifindex": ifb})


# ---------------------------------------------------------------------------- removal


def _step(removed: list[str], what: str, fn: Callable[..., Any], *args: Any,
          **kwargs: Any) -> None:
    """One removal step; an object that is already gone is not an error."""
    try:
        fn(*args, **kwargs)
    except NetlinkError as exc:
        if is_gone(exc) or exc.code == _EINVAL:  # EINVAL: no filter at that pref any more
            return
        raise
    removed.append(what)


def _remove_htb(ipr: IPRoute, index: int, st: dict[str, Any], removed: list[str]) -> None:
    root = _at(qdiscs(ipr, index), TC_H_ROOT)
    if root is None or root["handle"] != ROOT_HANDLE or root.get_attr("TCA_KIND") != "htb":
        return  # not ours (any more): nothing of ours can hang below it
    dev = st["ifname"]
    for pref in st.get("prefs", []):
        _step(removed, f"filter pref {pref} on {dev}", _del_filters, ipr, index, ROOT_HANDLE,
              pref)
    if "class_minor" in st:
        classid = ROOT_HANDLE | st["class_minor"]
        # Deleting the class deletes the leaf qdiscs hanging from it.
        _step(removed, f"class {fmt_handle(classid)} and its qdiscs on {dev}", ipr.tc,
              "del-class", None, index, classid, parent=ROOT_HANDLE)
    shaped = [c for c in classes(ipr, index) if c["handle"] != DEFAULT_CLASS]
    if not shaped and not filters(ipr, index, ROOT_HANDLE):
        _step(removed, f"root qdisc 5351: on {dev}", ipr.tc, "del", None, index, ROOT_HANDLE,
              parent=TC_H_ROOT)


def _remove_ingress(ipr: IPRoute, index: int, st: dict[str, Any], removed: list[str]) -> None:
    dev = st["ifname"]
    for pref in st.get("ingress_prefs", []):
        _step(removed, f"ingress filter pref {pref} on {dev}", _del_filters, ipr, index,
              INGRESS_HANDLE, pref)
    ingress = _at(qdiscs(ipr, index), TC_H_INGRESS)
    if (ingress is not None and ingress.get_attr("TCA_KIND") == "ingress"
            and st.get("ingress_owned") and not filters(ipr, index, INGRESS_HANDLE)):
        _step(removed, f"ingress qdisc on {dev}", ipr.tc, "del", "ingress", index,
              INGRESS_HANDLE)


def _remove_hop(st: dict[str, Any]) -> list[str]:
    netns = st.get("netns")
    removed: list[str] = []
    if netns and not netns_exists(netns):
        return removed  # the namespace is gone, and everything in it
    with iproute(netns) as ipr:
        found = ipr.link_lookup(ifname=st["ifname"])
        if found and st.get("via_ifb"):
            _remove_ingress(ipr, found[0], st, removed)
        elif found:
            _remove_htb(ipr, found[0], st, removed)
        ifb = ipr.link_lookup(ifname=st["ifb"]) if st.get("ifb") else []
        if ifb:
            _step(removed, f"ifb {st['ifb']}", ipr.link, "del", index=ifb[0])
    return removed


def leftovers(st: dict[str, Any]) -> list[str]:
    """This hop's own objects still in the kernel (none after a good revert)."""
    netns = st.get("netns")
    if netns and not netns_exists(netns):
        return []
    with iproute(netns) as ipr:
        left = [f"ifb {st['ifb']}"] if st.get("ifb") and ipr.link_lookup(ifname=st["ifb"]) else []
        found = ipr.link_lookup(ifname=st["ifname"])
        if not found:
            return left
        index = found[0]
        if st.get("via_ifb"):
            return left + [f"ingress filter pref {_pref(f)}" for f in
                           filters(ipr, index, INGRESS_HANDLE)
                           if _pref(f) in st.get("ingress_prefs", [])]
        present = qdiscs(ipr, index)
        root = _at(present, TC_H_ROOT)
        if root is None or root["handle"] != ROOT_HANDLE:
            return left
        left += [f"filter pref {_pref(f)}" for f in filters(ipr, index, ROOT_HANDLE)
                 if _pref(f) in st.get("prefs", [])]
        return left + [f"qdisc {fmt_handle(q['handle'])}" for q in present
                       if q["handle"] >> 16 in st.get("leaf_majors", [])]


def remove_hops(hops: list[dict[str, Any]], timeout_s: float) -> list[str]:
    """Remove what ``hops`` (journal state) installed, newest hop first; check none is left."""

    def work() -> list[str]:
        removed = [x for st in reversed(hops) for x in _remove_hop(st)]
        left = [x for st in hops for x in leftovers(st)]
        if left:
            raise RevertError(f"the tc fault is still partly in place after revert: "
                              f"{', '.join(left)}; run `streamquake recover`")
        return removed

    try:
        return run_with_deadline(work, timeout_s, "reverting the tc fault")
    except (NetlinkError, OSError, TimeoutError) as exc:
        where = ", ".join(h["ifname"] + (f" (netns {h['netns']})" if h.get("netns") else "")
                          for h in hops)
        raise RevertError(
            f"could not revert the tc fault on {where}: {exc}. It may still be in place: run "
            "`streamquake recover`, or remove it by hand (`tc qdisc del dev IFACE root` where "
            "the root is htb 5351:, `ip link del sqifb...`)"
        ) from exc


# ---------------------------------------------------------------------------- read-back


def read_hop(ipr: IPRoute, st: dict[str, Any], decoders: dict[str, Decoder]) -> dict[str, Any]:
    """The kernel's own view of what this fault installed on one hop."""
    index = _index(ipr, st.get("netns"), st["ifname"])
    view: dict[str, Any] = {"netns": st.get("netns"), "ifname": st["ifname"]}
    majors = st["leaf_majors"]
    if st.get("via_ifb"):
        ifb = _index(ipr, st.get("netns"), st["ifb"])
        return {**view, "ifb": st["ifb"],
                "qdiscs": [describe_qdisc(q, decoders) for q in qdiscs(ipr, ifb)
                           if q["handle"] >> 16 in majors],
                "filters": [describe_filter(f) for f in
                            _u32_nodes(ipr, index, INGRESS_HANDLE, st["ingress_prefs"])]}
    classid = ROOT_HANDLE | st["class_minor"]
    return {**view,
            "qdiscs": [describe_qdisc(q, decoders) for q in qdiscs(ipr, index)
                       if q["handle"] == ROOT_HANDLE or q["handle"] >> 16 in majors],
            "classes": [{"classid": fmt_handle(c["handle"]), **_decode_htb(c)}
                        for c in classes(ipr, index) if c["handle"] in (classid, DEFAULT_CLASS)],
            "filters": [describe_filter(f) for f in
                        _u32_nodes(ipr, index, ROOT_HANDLE, st["prefs"])]}


# ---------------------------------------------------------------------------- preflight


NO_NETEM = (
    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); netem faults cannot run on it: use a "
    "kernel built with sch_netem (`modprobe sch_netem` where it is a module), run inside "
    "User-Mode Linux (scripts/uml-run), or use a tbf fault for bandwidth limits"
)
NO_CAP = (
    "changing traffic control needs CAP_NET_ADMIN, which this process does not have: run "
    "streamquake as root (sudo), or leave the tc faults (netem, tbf) out of this scenario"
)
_FEATURE_CONFIG = {"tbf": "CONFIG_NET_SCH_TBF", "htb": "CONFIG_NET_SCH_HTB",
                   "u32": "CONFIG_NET_CLS_U32", "ifb": "CONFIG_IFB and CONFIG_NET_ACT_MIRRED"}


def _works(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    try:
        fn(*args, **kwargs)
        return True
    except NetlinkError:
        return False


@functools.cache
def kernel_features() -> frozenset[str]:
    """Which of netem, tbf, htb, u32, ifb (+ingress, mirred) this kernel has.

    Probed by really adding each to ``lo`` of a throwaway network namespace.
    """
    name = f"sqprobe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    found: set[str] = set()
    pr_netns.create(name)
    try:
        with iproute(name) as ipr:
            lo = ipr.link_lookup(ifname="lo")[0]
            for kind, kw in (("netem", {"delay": 1000}),
                             ("tbf", {"rate": 125000, "burst": 10000, "latency": 50000})):
                if _works(ipr.tc, "add", kind, lo, 0x10000, **kw):
                    found.add(kind)
                    ipr.tc("del", None, lo, 0x10000, parent=TC_H_ROOT)
            if _works(ipr.tc, "add", "htb", lo, ROOT_HANDLE, default=1):
                found.add("htb")
                if _works(_add_filters, ipr, lo, ROOT_HANDLE, [PREF_TOP], [_MATCH_ALL],
                          target=DEFAULT_CLASS):
                    found.add("u32")
            if (_works(ipr.link, "add", ifname="sqprobeifb", kind="ifb")
                    and _works(ipr.tc, "add", "ingress", lo, INGRESS_HANDLE)):
                ifb = ipr.link_lookup(ifname="sqprobeifb")[0]
                redirect = {"kind": "mirred", "direction": "egress", "action": "redirect",
                            "ifindex": ifb}
                if _works(_add_filters, ipr, lo, INGRESS_HANDLE, [PREF_TOP], [_MATCH_ALL],
                          target=0, action=redirect):
                    found.add("ifb")
    finally:
        pr_netns.remove(name)
    return frozenset(found)


def capability_problems(needs: set[str]) -> list[str]:
    """CAP_NET_ADMIN, then each kernel feature in ``needs`` (netem, tbf, htb, u32, ifb)."""
    if not has_cap_net_admin():
        return [NO_CAP]
    try:
        have = kernel_features()
    except (NetlinkError, OSError) as exc:
        return [f"could not probe this kernel's traffic control in a throwaway network "
                f"namespace ({exc}); streamquake needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"]
    problems = []
    if "netem" in needs and "netem" not in have:
        problems.append(NO_NETEM + (", which this kernel supports" if "tbf" in have else ""))
    problems += [f"this kernel has no {kind} support ({config}), which this tc fault needs: use "
                 "a kernel with it, or another scope/direction" for kind, config
                 in _FEATURE_CONFIG.items() if kind in needs and kind not in have]
    return problems


# ---------------------------------------------------------------------------- the scoped fault


class ScopedTc:
    """Installs a fault's leaf qdiscs on every hop that carries the target's packets."""

    apply_timeout_s = 15.0
    revert_timeout_s = 10.0

    def __init__(self, ctx: RunContext, placement: TcPlacement, leaves: Sequence[LeafQdisc],
                 decoders: dict[str, Decoder] | None = None) -> None:
        self.ctx = ctx
        self.placement = resolve_placement(placement, ctx)
        self.leaves = list(leaves)
        self.decoders = decoders or {}
        self._hops: list[dict[str, Any]] = []

    def preflight(self) -> list[str]:
        problems = capability_problems({leaf.kind for leaf in self.leaves} | {"htb", "u32"})
        if problems or (self.ctx.target_netns and not netns_exists(self.ctx.target_netns)):
            return problems  # no namespace yet: apply checks the hops
        try:
            hops = plan_hops(self.ctx, self.placement)
            if any(h.via_ifb for h in hops):
                problems += capability_problems({"ifb"})
            for hop in hops:
                with iproute(hop.netns) as ipr:
                    problem = _ownership_problem(ipr, hop)
                if problem:
                    problems.append(problem)
        except InjectorError as exc:
            problems.append(str(exc))
        except (NetlinkError, OSError) as exc:
            problems.append(f"cannot find the route to the target {self.ctx.target_host}: {exc}")
        return problems

    def apply(self, entry: JournalEntry) -> dict[str, Any]:
        """Install on every hop; return the hops, the kernel's read-back, and apply_ms."""
        started = time.perf_counter()
        try:
            run_with_deadline(lambda: self._apply(entry), self.apply_timeout_s,
                              "applying the tc fault")
        except BaseException as exc:
            with contextlib.suppress(RevertError):  # the journal keeps the state for recover
                self.revert()
            if isinstance(exc, NetlinkError | OSError | TimeoutError):
                raise InjectorError(f"could not apply the tc fault: {exc}") from exc
            raise
        apply_ms = (time.perf_counter() - started) * 1000
        return {"hops": self.hop_states(), "kernel": self.read_back(), "apply_ms": apply_ms}

    def _apply(self, entry: JournalEntry) -> None:
        hops = plan_hops(self.ctx, self.placement)
        addrs = resolve_addresses(self.ctx.target_host)
        for hop in hops:
            st: dict[str, Any] = {"netns": hop.netns, "ifname": hop.ifname, "match": hop.match,
                                  "via_ifb": hop.via_ifb}
            self._hops.append(st)
            install = _install_ifb if hop.via_ifb else _install_htb
            with iproute(hop.netns) as ipr:
                install(ipr, hop, st, self.leaves,
                        _u32_selectors(addrs, self.ctx.target_port, hop.match),
                        lambda: entry.save({"hops": self._hops}))

    def hop_states(self) -> list[dict[str, Any]]:
        return [dict(h) for h in self._hops]

    def read_back(self) -> list[dict[str, Any]]:
        views = []
        for st in self._hops:
            with iproute(st.get("netns")) as ipr:
                views.append(read_hop(ipr, st, self.decoders))
        return views

    def revert(self) -> dict[str, Any]:
        """Remove what apply installed; idempotent, and fine after a partial apply."""
        started = time.perf_counter()
        removed = remove_hops(self._hops, self.revert_timeout_s) if self._hops else []
        self._hops = []
        return {"removed": removed, "revert_ms": (time.perf_counter() - started) * 1000}

    @classmethod
    def recover(cls, state: dict[str, Any]) -> str:
        removed = remove_hops(state.get("hops", []), cls.revert_timeout_s)
        return ("removed " + "; ".join(removed)) if removed else "nothing of it was left"
