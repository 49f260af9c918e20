"""Where a tc fault lands: the target's packets only, on the interfaces that carry them.

Shared by the netem and tbf injectors, which hand in the qdisc(s) to install ("leaves"). All
changes go through rtnetlink (pyroute2), never through the ``tc`` program.

Layout on every interface we shape, in ``tc`` notation::

    qdisc htb 5351: root default 1                   our root (reserved handle 5351:, "SQ")
      class htb 5351:1   rate 100gbit                unshaped: everything unmatched (SSH...)
      class htb 5351:10  rate 100gbit                one shaped class per applied fault
        qdisc netem|tbf 5352: parent 5351:10         the fault (leaf handles 5352: to 53ff:)
      filter pref 21328 u32 ip dst T/32 tcp dport P -> flowid 5351:10

Filter prefs come from 0x5300-0x5350, each new fault taking one below the lowest in use, so
that the newest fault on a path sees the packets and an older one (a whole-run network profile)
takes over again when it is reverted.

Where each direction is shaped: packets toward the target leave the load generator's interface
(the route to the target, or ``interface``). With ``direction: both`` the answers are shaped as
they leave the target's end of the veth pair (namespace mode), or leave ``lo`` (a local target),
or, for a remote target, as they arrive: an ``ingress`` qdisc with a u32 filter at one of our
prefs redirects them (mirred) to an ifb device of ours, ``sqifb<id>``, whose root is the fault.

Ownership: a root qdisc with handle 0: is the kernel's default and may be replaced; 5351: htb is
ours and is shared; anything else belongs to someone else and is never touched: apply refuses
and says how to remove it. An ``ingress`` qdisc is reused only when every filter on it is ours.
Revert removes exactly the filters, class, leaves and ifb it created, then our root once no
shaped class is left, and the ``ingress`` qdisc once no filter is left on it.

The u32 port match assumes a 20-byte IPv4 header (no options), as ``tc ... match ip dport``
does; Linux does not put options on TCP packets.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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

Match = Literal["to_target", "from_target", "all"]


class TcPlacement(BaseModel):
    """Per-fault overrides of the scenario's ``network:`` section (None: take it from there)."""

    interface: str | None = None
    scope: Literal["target", "interface"] | None = None
    direction: Literal["egress", "both"] | None = None


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


Decoder = Callable[[Any], dict[str, Any]]


# ---------------------------------------------------------------------------- handles


def fmt_handle(h: int) -> str:
    if h == TC_H_ROOT:
        return "root"
    if h == TC_H_INGRESS:
        return "ingress"
    major, minor = h >> 16, h & 0xFFFF
    return f"{major:x}:{minor:x}" if minor else f"{major:x}:"


# ---------------------------------------------------------------------------- dumps


def _dump(ipr: IPRoute, msg_type: int, index: int, parent: int = 0) -> list[Any]:
    msg = tcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = index
    msg["parent"] = parent
    return [
        m for m in ipr.nlm_request(msg, msg_type, NLM_F_REQUEST | NLM_F_DUMP)
        if m.get("index") == index
    ]


def qdiscs(ipr: IPRoute, index: int) -> list[Any]:
    return _dump(ipr, RTM_GETQDISC, index)


def classes(ipr: IPRoute, index: int) -> list[Any]:
    return _dump(ipr, RTM_GETTCLASS, index)


def filters(ipr: IPRoute, index: int, parent: int) -> list[Any]:
    return _dump(ipr, RTM_GETTFILTER, index, parent)


def _root(ipr: IPRoute, index: int) -> Any | None:
    return next((q for q in qdiscs(ipr, index) if q["parent"] == TC_H_ROOT), None)


def _pref(f: Any) -> int:
    return int(f["info"]) >> 16


def _ours(pref: int) -> bool:
    return PREF_FLOOR <= pref <= PREF_TOP


# ---------------------------------------------------------------------------- decoding


def _decode_htb(msg: Any) -> dict[str, Any]:
    opts = msg.get_attr("TCA_OPTIONS")
    if opts is None:
        return {}
    init = opts.get_attr("TCA_HTB_INIT")
    if init is not None:
        return {"default": f"{init['defcls']:x}"}
    parms = opts.get_attr("TCA_HTB_PARMS") or {}
    rate = opts.get_attr("TCA_HTB_RATE64") or parms.get("rate")
    ceil = opts.get_attr("TCA_HTB_CEIL64") or parms.get("ceil")
    return {"rate_bytes_per_s": rate, "ceil_bytes_per_s": ceil}


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


@functools.cache
def psched_ns_per_tick() -> int:
    try:
        with open("/proc/net/psched") as fh:
            return int(fh.read().split()[1], 16)
    except (OSError, IndexError, ValueError):
        return 64  # PSCHED_SHIFT 6, unchanged since Linux 2.6.31


def describe_qdisc(msg: Any, decoders: dict[str, Decoder]) -> dict[str, Any]:
    kind = msg.get_attr("TCA_KIND")
    view: dict[str, Any] = {
        "kind": kind, "handle": fmt_handle(msg["handle"]), "parent": fmt_handle(msg["parent"]),
    }
    decoder = decoders.get(kind) or _DECODERS.get(kind)
    if decoder is not None:
        view["options"] = decoder(msg)
    stats = msg.get_attr("TCA_STATS")
    if stats is not None:
        view["stats"] = {"bytes": stats["bytes"], "packets": stats["packets"],
                         "drops": stats["drop"]}
    return view


def describe_filter(msg: Any) -> dict[str, Any]:
    opts = msg.get_attr("TCA_OPTIONS")
    view: dict[str, Any] = {
        "kind": msg.get_attr("TCA_KIND"), "pref": _pref(msg),
        "protocol": f"{socket.ntohs(int(msg['info']) & 0xFFFF):#06x}",
        "parent": fmt_handle(msg["parent"]),
    }
    if opts is None:
        return view
    classid = opts.get_attr("TCA_U32_CLASSID")
    if classid:
        view["flowid"] = fmt_handle(classid)
    sel = opts.get_attr("TCA_U32_SEL")
    if sel is not None:
        view["keys"] = _u32_keys(sel)
    act = opts.get_attr("TCA_U32_ACT")
    if act is not None:
        for prio in act.get("attrs", []):
            a = prio[1]
            if a.get_attr("TCA_ACT_KIND") == "mirred":
                parms = a.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
                view["action"] = {"kind": "mirred", "eaction": parms["eaction"],
                                  "ifindex": parms["ifindex"]}
    return view


# ---------------------------------------------------------------------------- u32 keys


def _u32_keys(sel: Any) -> list[str]:
    """Keys of a dumped u32 selector, as ``tc filter show`` prints them ("val/mask at off").

    Read from the raw attribute: pyroute2 0.9.7 decodes the keys from the wrong offset.
    """
    raw = bytes(sel.data[sel.offset + 4: sel.offset + sel.length])
    nkeys = raw[2]
    keys = []
    for i in range(nkeys):
        mask, val = struct.unpack_from(">II", raw, 16 + 16 * i)  # __be32 mask, val
        (off,) = struct.unpack_from("=i", raw, 16 + 16 * i + 8)  # int off, host order
        keys.append(f"{val:08x}/{mask:08x} at {off}")
    return keys


def _u32_selectors(addrs: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address], port: int,
                   match: Match) -> list[tuple[int, list[str]]]:
    """(ethertype, u32 keys) per target address; keys are pyroute2's 'val/mask+offset'.

    Address and port only, no protocol byte: TCP and UDP (HTTP/3) to the target's port are
    both its traffic.
    """
    if match == "all":
        return [(_ETH_P_ALL, ["0x0/0x0+0"])]
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


# ---------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Placement:
    interface: str | None
    scope: str
    direction: str


def resolve_placement(spec: TcPlacement, ctx: RunContext) -> Placement:
    net = ctx.extra.get("network")
    if isinstance(net, dict):
        net = NetworkConfig.model_validate(net)
    if net is None:
        net = NetworkConfig(mode="namespace" if ctx.target_netns else "host")
    return Placement(
        interface=spec.interface or net.interface,
        scope=spec.scope or net.scope,
        direction=spec.direction or net.direction,
    )


def resolve_addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InjectorError(
            f"cannot resolve the target host {host!r} to scope the tc fault: {exc}"
        ) from exc
    return sorted({ipaddress.ip_address(i[4][0]) for i in infos}, key=str)


def _route(ipr: IPRoute, dst: str) -> tuple[str, str | None, bool]:
    msg = ipr.route("get", dst=dst)[0]
    oif = msg.get_attr("RTA_OIF")
    ifname = ipr.get_links(oif)[0].get_attr("IFLA_IFNAME")
    return ifname, msg.get_attr("RTA_PREFSRC"), msg["type"] == _RTN_LOCAL


def plan_hops(ctx: RunContext, placement: Placement) -> list[Hop]:
    """The interfaces (and namespaces) that carry the target's packets, one Hop per direction."""
    client_ns = ctx.extra.get("client_netns")
    addrs = resolve_addresses(ctx.target_host)
    out_match: Match = "all" if placement.scope == "interface" else "to_target"
    in_match: Match = "all" if placement.scope == "interface" else "from_target"
    with iproute(client_ns) as ipr:
        route_dev, prefsrc, local = _route(ipr, str(addrs[0]))
        dev = placement.interface or route_dev
        if not ipr.link_lookup(ifname=dev):
            where = f" in network namespace {client_ns}" if client_ns else ""
            raise InjectorError(f"interface {dev!r} does not exist{where}; check network.interface")
    hops = [Hop(client_ns, dev, out_match)]
    if placement.direction != "both":
        return hops
    if ctx.target_netns:
        with iproute(ctx.target_netns) as nsr:
            back_dev, _, _ = _route(nsr, prefsrc or "0.0.0.0")
        hops.append(Hop(ctx.target_netns, back_dev, in_match))
    elif local or dev == "lo":
        # Loopback egress carries both directions; one "all" hop already covers them.
        if in_match != "all":
            hops.append(Hop(client_ns, dev, in_match))
    else:
        hops.append(Hop(client_ns, dev, in_match, via_ifb=True))
    return hops


# ---------------------------------------------------------------------------- ownership


def _foreign_root_problem(root: Any | None, hop: Hop) -> str | None:
    if root is None or root["handle"] == 0:
        return None  # the kernel's default qdisc: ours to replace, restored when we leave
    kind = root.get_attr("TCA_KIND")
    if root["handle"] == ROOT_HANDLE and kind == "htb":
        return None
    where = f" -n {hop.netns}" if hop.netns else ""
    return (
        f"interface {hop.ifname} already has a root qdisc ({kind} {fmt_handle(root['handle'])}) "
        f"that streamquake did not install, and streamquake never replaces someone else's; "
        f"if it is no longer needed remove it with `tc{where} qdisc del dev {hop.ifname} root`, "
        "or shape another interface"
    )


def _foreign_ingress_problem(ipr: IPRoute, index: int, hop: Hop) -> str | None:
    ing = next((q for q in qdiscs(ipr, index) if q["parent"] == TC_H_INGRESS), None)
    if ing is None:
        return None
    kind = ing.get_attr("TCA_KIND")
    theirs = [f for f in filters(ipr, index, INGRESS_HANDLE) if not _ours(_pref(f))]
    if kind == "ingress" and not theirs:
        return None
    where = f" -n {hop.netns}" if hop.netns else ""
    return (
        f"interface {hop.ifname} already has an {kind} qdisc with filters that streamquake did "
        f"not install; shaping the target's answers would need it. Remove it with "
        f"`tc{where} qdisc del dev {hop.ifname} {kind}` or use direction: egress"
    )


# ---------------------------------------------------------------------------- install


def _free(candidates: Sequence[int], used: set[int], n: int, what: str) -> list[int]:
    free = [c for c in candidates if c not in used][:n]
    if len(free) < n:
        raise InjectorError(f"no free {what} left in streamquake's reserved range; "
                            "revert or recover earlier faults first")
    return free


def _new_prefs(existing: set[int], n: int) -> list[int]:
    ours = [p for p in existing if _ours(p)]
    top = (min(ours) - 1) if ours else PREF_TOP
    prefs = list(range(top, top - n, -1))
    if prefs and prefs[-1] < PREF_FLOOR:
        raise InjectorError("too many streamquake filters on one interface; revert some faults")
    return prefs


def _add_filters(ipr: IPRoute, index: int, parent: int, prefs: list[int],
                 selectors: list[tuple[int, list[str]]], **extra: Any) -> None:
    for pref, (proto, keys) in zip(prefs, selectors, strict=True):
        ipr.tc("add-filter", "u32", index=index, parent=parent, prio=pref, protocol=proto,
               keys=keys, **extra)


def _install_htb_hop(ipr: IPRoute, hop: Hop, st: dict[str, Any], leaves: Sequence[LeafQdisc],
                     selectors: list[tuple[int, list[str]]], save: Callable[[], None]) -> None:
    index = _index(ipr, hop)
    present = qdiscs(ipr, index)
    root = next((q for q in present if q["parent"] == TC_H_ROOT), None)
    problem = _foreign_root_problem(root, hop)
    if problem:
        raise InjectorError(problem)
    ours_root = root is not None and root["handle"] == ROOT_HANDLE
    cls_minors = {c["handle"] & 0xFFFF for c in classes(ipr, index)} if ours_root else set()
    prefs_in_use = {_pref(f) for f in filters(ipr, index, ROOT_HANDLE)} if ours_root else set()
    st["class_minor"] = _free(range(FIRST_SHAPED_MINOR, 0xFFFF), cls_minors, 1, "class id")[0]
    st["leaf_majors"] = _free(LEAF_MAJORS, {q["handle"] >> 16 for q in present}, len(leaves),
                              "qdisc handle")
    st["prefs"] = _new_prefs(prefs_in_use, len(selectors))
    save()  # everything recover needs is on disk before the first change
    if not ours_root:
        ipr.tc("add", "htb", index=index, handle=ROOT_HANDLE, parent=TC_H_ROOT, default=1)
    if 1 not in cls_minors:
        _add_unshaped_class(ipr, index, DEFAULT_CLASS)
    classid = ROOT_HANDLE | st["class_minor"]
    _add_unshaped_class(ipr, index, classid)
    _add_chain(ipr, index, classid, leaves, st["leaf_majors"])
    _add_filters(ipr, index, ROOT_HANDLE, st["prefs"], selectors, target=classid)


def _add_unshaped_class(ipr: IPRoute, index: int, classid: int) -> None:
    ipr.tc("add-class", "htb", index=index, handle=classid, parent=ROOT_HANDLE,
           rate=UNSHAPED_BYTES_PER_S, ceil=UNSHAPED_BYTES_PER_S, quantum=_HTB_QUANTUM)


def _add_chain(ipr: IPRoute, index: int, parent: int, leaves: Sequence[LeafQdisc],
               majors: list[int]) -> None:
    for leaf, major in zip(leaves, majors, strict=True):
        leaf.add(ipr, index, parent, major << 16)
        parent = (major << 16) | 1  # the next leaf hangs under this one's single class


def _install_ifb_hop(ipr: IPRoute, hop: Hop, st: dict[str, Any], leaves: Sequence[LeafQdisc],
                     selectors: list[tuple[int, list[str]]], save: Callable[[], None]) -> None:
    index = _index(ipr, hop)
    problem = _foreign_ingress_problem(ipr, index, hop)
    if problem:
        raise InjectorError(problem)
    has_ingress = any(q["parent"] == TC_H_INGRESS for q in qdiscs(ipr, index))
    prefs_in_use = {_pref(f) for f in filters(ipr, index, INGRESS_HANDLE)} if has_ingress else set()
    st["ifb"] = f"{IFB_PREFIX}{uuid.uuid4().hex[:8]}"
    st["leaf_majors"] = list(LEAF_MAJORS[: len(leaves)])
    st["ingress_prefs"] = _new_prefs(prefs_in_use, len(selectors))
    save()
    ipr.link("add", ifname=st["ifb"], kind="ifb")
    ifb_index = ipr.link_lookup(ifname=st["ifb"])[0]
    ipr.link("set", index=ifb_index, state="up")
    _add_chain(ipr, ifb_index, TC_H_ROOT, leaves, st["leaf_majors"])
    if not has_ingress:
        ipr.tc("add", "ingress", index=index, handle=INGRESS_HANDLE)
    _add_filters(ipr, index, INGRESS_HANDLE, st["ingress_prefs"], selectors, target=0,
                 action={"kind": "mirred", "direction": "egress", "action": "redirect",
                         "ifindex": ifb_index})


def _index(ipr: IPRoute, hop: Hop) -> int:
    found = ipr.link_lookup(ifname=hop.ifname)
    if not found:
        where = f" in network namespace {hop.netns}" if hop.netns else ""
        raise InjectorError(f"interface {hop.ifname!r} does not exist{where}")
    return int(found[0])


# ---------------------------------------------------------------------------- removal


def _ignore_gone(fn: Callable[[], Any]) -> bool:
    """Run one removal step; False when the object was already gone."""
    try:
        fn()
        return True
    except NetlinkError as exc:
        if is_gone(exc) or exc.code == 22:  # EINVAL: no filter at that pref any more
            return False
        raise


def _del_filters(ipr: IPRoute, index: int, parent: int, pref: int) -> None:
    """Delete every filter at ``pref`` under ``parent`` (any protocol, any handle)."""
    msg = tcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = index
    msg["parent"] = parent
    msg["info"] = pref << 16
    tuple(ipr.nlm_request(msg, RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK))


def _remove_hop(st: dict[str, Any]) -> list[str]:
    netns, ifname = st.get("netns"), st["ifname"]
    if netns and not netns_exists(netns):
        return []
    removed: list[str] = []
    try:
        with iproute(netns) as ipr:
            found = ipr.link_lookup(ifname=ifname)
            if not found:
                if st.get("ifb"):
                    _remove_ifb(ipr, st, removed)
                return removed
            index = found[0]
            if st.get("via_ifb"):
                _remove_ingress_part(ipr, index, st, removed)
                _remove_ifb(ipr, st, removed)
            else:
                _remove_htb_part(ipr, index, st, removed)
    except FileNotFoundError:
        return removed  # the namespace went away underneath us: so did everything in it
    return removed


def _remove_htb_part(ipr: IPRoute, index: int, st: dict[str, Any], removed: list[str]) -> None:
    root = _root(ipr, index)
    if root is None or root["handle"] != ROOT_HANDLE or root.get_attr("TCA_KIND") != "htb":
        return  # not ours (any more): nothing of ours can hang below it
    for pref in st.get("prefs", []):
        if _ignore_gone(lambda p=pref: _del_filters(ipr, index, ROOT_HANDLE, p)):
            removed.append(f"filter pref {pref} on {st['ifname']}")
    minor = st.get("class_minor")
    if minor is not None:
        classid = ROOT_HANDLE | minor
        # Deleting the class deletes the leaf qdiscs hanging from it.
        if _ignore_gone(lambda: ipr.tc("del-class", index=index, handle=classid,
                                       parent=ROOT_HANDLE)):
            removed.append(f"class {fmt_handle(classid)} and its qdiscs on {st['ifname']}")
    shaped_left = [c for c in classes(ipr, index)
                   if c["handle"] >> 16 == ROOT_MAJOR and c["handle"] != DEFAULT_CLASS]
    if not shaped_left and not filters(ipr, index, ROOT_HANDLE):
        if _ignore_gone(lambda: ipr.tc("del", index=index, handle=ROOT_HANDLE, parent=TC_H_ROOT)):
            removed.append(f"root qdisc 5351: on {st['ifname']}")


def _remove_ingress_part(ipr: IPRoute, index: int, st: dict[str, Any],
                         removed: list[str]) -> None:
    for pref in st.get("ingress_prefs", []):
        if _ignore_gone(lambda p=pref: _del_filters(ipr, index, INGRESS_HANDLE, p)):
            removed.append(f"ingress filter pref {pref} on {st['ifname']}")
    ing = next((q for q in qdiscs(ipr, index) if q["parent"] == TC_H_INGRESS), None)
    if ing is None or ing.get_attr("TCA_KIND") != "ingress":
        return
    if not filters(ipr, index, INGRESS_HANDLE) and st.get("ingress_owned"):
        if _ignore_gone(lambda: ipr.tc("del", "ingress", index=index, handle=INGRESS_HANDLE)):
            removed.append(f"ingress qdisc on {st['ifname']}")


def _remove_ifb(ipr: IPRoute, st: dict[str, Any], removed: list[str]) -> None:
    name = st.get("ifb")
    if not name:
        return
    found = ipr.link_lookup(ifname=name)
    if found and _ignore_gone(lambda: ipr.link("del", index=found[0])):
        removed.append(f"ifb {name}")


# ---------------------------------------------------------------------------- read-back


def read_hop(ipr: IPRoute, st: dict[str, Any], decoders: dict[str, Decoder]) -> dict[str, Any]:
    """The kernel's own view of what this fault installed on one hop."""
    view: dict[str, Any] = {"netns": st.get("netns"), "ifname": st["ifname"]}
    found = ipr.link_lookup(ifname=st["ifname"])
    if not found:
        return {**view, "missing": True}
    index = found[0]
    majors = set(st.get("leaf_majors", []))
    if st.get("via_ifb"):
        view["filters"] = [describe_filter(f) for f in filters(ipr, index, INGRESS_HANDLE)
                           if _pref(f) in st.get("ingress_prefs", []) and f.get_attr("TCA_OPTIONS")
                           and f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_SEL") is not None]
        ifb = ipr.link_lookup(ifname=st["ifb"])
        view["ifb"] = st["ifb"]
        view["qdiscs"] = ([describe_qdisc(q, decoders) for q in qdiscs(ipr, ifb[0])
                           if q["handle"] >> 16 in majors] if ifb else [])
        return view
    classid = ROOT_HANDLE | st.get("class_minor", 0)
    view["qdiscs"] = [describe_qdisc(q, decoders) for q in qdiscs(ipr, index)
                      if q["handle"] == ROOT_HANDLE or q["handle"] >> 16 in majors]
    view["classes"] = [{"classid": fmt_handle(c["handle"]), **_decode_htb(c)}
                       for c in classes(ipr, index) if c["handle"] in (classid, DEFAULT_CLASS)]
    view["filters"] = [describe_filter(f) for f in filters(ipr, index, ROOT_HANDLE)
                       if _pref(f) in st.get("prefs", []) and f.get_attr("TCA_OPTIONS")
                       and f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_SEL") is not None]
    return view


def leftovers(st: dict[str, Any]) -> list[str]:
    """What of this hop's own objects is still in the kernel (empty after a good revert)."""
    netns = st.get("netns")
    if netns and not netns_exists(netns):
        return []
    left: list[str] = []
    with iproute(netns) as ipr:
        if st.get("ifb") and ipr.link_lookup(ifname=st["ifb"]):
            left.append(f"ifb {st['ifb']}")
        found = ipr.link_lookup(ifname=st["ifname"])
        if not found:
            return left
        index = found[0]
        if st.get("via_ifb"):
            left += [f"ingress filter pref {_pref(f)}" for f in filters(ipr, index, INGRESS_HANDLE)
                     if _pref(f) in st.get("ingress_prefs", [])]
            return left
        root = _root(ipr, index)
        if root is None or root["handle"] != ROOT_HANDLE:
            return left
        left += [f"filter pref {_pref(f)}" for f in filters(ipr, index, ROOT_HANDLE)
                 if _pref(f) in st.get("prefs", [])]
        left += [f"qdisc {fmt_handle(q['handle'])}" for q in qdiscs(ipr, index)
                 if q["handle"] >> 16 in set(st.get("leaf_majors", []))]
    return left


# ---------------------------------------------------------------------------- preflight


@functools.cache
def kernel_features() -> frozenset[str]:
    """Which qdiscs/classifiers/actions this kernel has, probed in a throwaway namespace."""
    name = f"sqprobe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    found: set[str] = set()
    pr_netns.create(name)
    try:
        with iproute(name) as ipr:
            lo = ipr.link_lookup(ifname="lo")[0]
            ipr.link("set", index=lo, state="up")
            for kind, kw in (("netem", {"delay": 1000}),
                             ("tbf", {"rate": 125000, "burst": 10000, "latency": 50000})):
                if _try(lambda k=kind, a=kw: ipr.tc("add", k, index=lo, handle=0x10000, **a)):
                    found.add(kind)
                    ipr.tc("del", index=lo, handle=0x10000, parent=TC_H_ROOT)
            if _try(lambda: ipr.tc("add", "htb", index=lo, handle=ROOT_HANDLE, default=1)):
                found.add("htb")
                if _try(lambda: _add_filters(ipr, lo, ROOT_HANDLE, [PREF_TOP],
                                             [(_ETH_P_ALL, ["0x0/0x0+0"])], target=DEFAULT_CLASS)):
                    found.add("u32")
            if _try(lambda: ipr.link("add", ifname="sqprobeifb", kind="ifb")):
                ifb = ipr.link_lookup(ifname="sqprobeifb")[0]
                if _try(lambda: ipr.tc("add", "ingress", index=lo, handle=INGRESS_HANDLE)) and _try(
                    lambda: _add_filters(ipr, lo, INGRESS_HANDLE, [PREF_TOP],
                                         [(_ETH_P_ALL, ["0x0/0x0+0"])], target=0,
                                         action={"kind": "mirred", "direction": "egress",
                                                 "action": "redirect", "ifindex": ifb})):
                    found.add("ifb")
    finally:
        pr_netns.remove(name)
    return frozenset(found)


def _try(fn: Callable[[], Any]) -> bool:
    try:
        fn()
        return True
    except NetlinkError:
        return False


NO_NETEM = (
    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); netem faults cannot run on it: use a "
    "kernel built with sch_netem (`modprobe sch_netem` where it is a module), run inside "
    "User-Mode Linux (scripts/uml-run), or use a tbf fault for bandwidth limits"
)
NO_CAP = (
    "changing traffic control needs CAP_NET_ADMIN, which this process does not have: run "
    "streamquake as root (sudo), or give up the tc faults (netem, tbf) in this scenario"
)


def capability_problems(needs: set[str]) -> list[str]:
    """CAP_NET_ADMIN, and each kernel feature in ``needs`` (netem, tbf, htb, u32, ifb)."""
    if not has_cap_net_admin():
        return [NO_CAP]
    try:
        have = kernel_features()
    except (NetlinkError, OSError) as exc:
        return [f"could not probe this kernel's traffic control in a throwaway network "
                f"namespace ({exc}); streamquake needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN"]
    problems = []
    if "netem" in needs and "netem" not in have:
        problems.append(NO_NETEM + (", which this kernel supports" if "tbf" in have else ""))
    for kind, config in (("tbf", "CONFIG_NET_SCH_TBF"), ("htb", "CONFIG_NET_SCH_HTB"),
                         ("u32", "CONFIG_NET_CLS_U32"), ("ifb", "CONFIG_IFB and CONFIG_NET_ACT_MIRRED")):
        if kind in needs and kind not in have:
            problems.append(f"this kernel has no {kind} support ({config}), which the tc fault "
                            "needs; use a kernel with it or change the fault's scope/direction")
    return problems


# ---------------------------------------------------------------------------- the scoped fault


@dataclass
class ScopedTc:
    """Installs a fault's leaf qdiscs on every hop that carries the target's packets."""

    ctx: RunContext
    placement_spec: TcPlacement
    leaves: Sequence[LeafQdisc]
    decoders: dict[str, Decoder] = field(default_factory=dict)
    apply_timeout_s: float = 15.0
    revert_timeout_s: float = 10.0
    _hops: list[dict[str, Any]] = field(default_factory=list)
    _entry: JournalEntry | None = None

    @property
    def placement(self) -> Placement:
        return resolve_placement(self.placement_spec, self.ctx)

    def needs(self) -> set[str]:
        needs = {leaf.kind for leaf in self.leaves} | {"htb", "u32"}
        p = self.placement
        if p.direction == "both" and not self.ctx.target_netns:
            needs.add("ifb")  # only a remote target needs it; plan_hops decides for real
        return needs

    def preflight(self) -> list[str]:
        problems = capability_problems(self.needs())
        if problems:
            return problems
        if self.ctx.target_netns and not netns_exists(self.ctx.target_netns):
            return []  # the topology is not up yet: apply checks the hops
        try:
            hops = plan_hops(self.ctx, self.placement)
            for hop in hops:
                with iproute(hop.netns) as ipr:
                    index = _index(ipr, hop)
                    problem = (_foreign_ingress_problem(ipr, index, hop) if hop.via_ifb
                               else _foreign_root_problem(_root(ipr, index), hop))
                if problem:
                    problems.append(problem)
        except InjectorError as exc:
            problems.append(str(exc))
        except (NetlinkError, OSError) as exc:
            problems.append(f"cannot find the path to the target {self.ctx.target_host}: {exc}")
        return problems

    def apply(self, entry: JournalEntry) -> dict[str, Any]:
        self._entry = entry
        started = time.perf_counter()
        try:
            run_with_deadline(self._apply, self.apply_timeout_s, "applying the tc fault")
        except BaseException as exc:
            try:
                self.revert()
            except RevertError:
                pass  # the journal still holds the state for `streamquake recover`
            if isinstance(exc, InjectorError):
                raise
            if isinstance(exc, NetlinkError | OSError | TimeoutError):
                raise InjectorError(f"could not apply the tc fault: {exc}") from exc
            raise
        apply_ms = (time.perf_counter() - started) * 1000
        return {"hops": self.hop_states(), "kernel": self.read_back(), "apply_ms": apply_ms}

    def _apply(self) -> None:
        hops = plan_hops(self.ctx, self.placement)
        addrs = resolve_addresses(self.ctx.target_host)
        assert self._entry is not None
        entry = self._entry

        def save() -> None:
            entry.save({"tc_scope": 1, "hops": self._hops})

        for hop in hops:
            st: dict[str, Any] = {"netns": hop.netns, "ifname": hop.ifname, "match": hop.match,
                                  "via_ifb": hop.via_ifb}
            self._hops.append(st)
            selectors = _u32_selectors(addrs, self.ctx.target_port, hop.match)
            with iproute(hop.netns) as ipr:
                if hop.via_ifb:
                    index = _index(ipr, hop)
                    present = qdiscs(ipr, index)
                    ing = [q for q in present if q["parent"] == TC_H_INGRESS]
                    # An ingress qdisc whose filters are all ours is ours to remove later.
                    st["ingress_owned"] = not ing or bool(filters(ipr, index, INGRESS_HANDLE))
                    _install_ifb_hop(ipr, hop, st, self.leaves, selectors, save)
                else:
                    _install_htb_hop(ipr, hop, st, self.leaves, selectors, save)

    def hop_states(self) -> list[dict[str, Any]]:
        return [dict(h) for h in self._hops]

    def read_back(self) -> list[dict[str, Any]]:
        views = []
        for st in self._hops:
            with iproute(st.get("netns")) as ipr:
                views.append(read_hop(ipr, st, self.decoders))
        return views

    def revert(self) -> dict[str, Any]:
        started = time.perf_counter()
        if not self._hops:
            return {"removed": [], "revert_ms": 0.0}
        removed = _remove_all({"hops": self._hops}, self.revert_timeout_s)
        left = [x for st in self._hops for x in leftovers(st)]
        if left:
            raise RevertError(f"the tc fault is still partly in place after revert: "
                              f"{', '.join(left)}; run `streamquake recover`")
        self._hops = []
        return {"removed": removed, "revert_ms": (time.perf_counter() - started) * 1000}

    @classmethod
    def recover(cls, state: dict[str, Any]) -> str:
        removed = _remove_all(state, cls.revert_timeout_s)
        return ("removed " + "; ".join(removed)) if removed else "nothing of it was left"


def _remove_all(state: dict[str, Any], timeout_s: float) -> list[str]:
    hops = list(reversed(state.get("hops", [])))

    def work() -> list[str]:
        return [x for st in hops for x in _remove_hop(st)]

    try:
        return run_with_deadline(work, timeout_s, "reverting the tc fault")
    except (NetlinkError, OSError, TimeoutError) as exc:
        where = ", ".join(f"{h['ifname']}" + (f" (netns {h['netns']})" if h.get("netns") else "")
                          for h in hops)
        raise RevertError(
            f"could not revert the tc fault on {where}: {exc}. The fault may still be in place; "
            "run `streamquake recover`, or remove it with `tc qdisc del dev IFACE root` "
            "(root handle 5351:)"
        ) from exc
