"""The kernel's own view of an installed tc fault: dumped qdiscs, classes and u32 filters,
decoded into a small typed model whose ``to_json()`` is the fault's ``kernel`` read-back."""

from __future__ import annotations

import functools
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute

from streamquake.faults.tc.netlink import (
    DEFAULT_CLASS,
    INGRESS_HANDLE,
    ROOT_HANDLE,
    classes,
    filter_pref,
    filters,
    fmt_handle,
    link_index,
    qdiscs,
)
from streamquake.faults.tc.state import HopState
from streamquake.jsontypes import JsonDict

# A dumped pyroute2 message (untyped) -> its kind's options, in kernel units.
Decoder = Callable[[Any], JsonDict]


@dataclass(frozen=True, slots=True)
class QdiscStats:
    bytes: int
    packets: int
    drops: int

    def to_json(self) -> JsonDict:
        return {"bytes": self.bytes, "packets": self.packets, "drops": self.drops}


@dataclass(frozen=True, slots=True)
class QdiscView:
    """``options`` only for a kind with a decoder (htb, tbf, and what the fault hands in)."""

    kind: str
    handle: str
    parent: str
    options: JsonDict | None = None
    stats: QdiscStats | None = None

    def to_json(self) -> JsonDict:
        out: JsonDict = {"kind": self.kind, "handle": self.handle, "parent": self.parent}
        if self.options is not None:
            out["options"] = self.options
        if self.stats is not None:
            out["stats"] = self.stats.to_json()
        return out


@dataclass(frozen=True, slots=True)
class ClassView:
    """An htb class; its options (rate, ceil) sit beside ``classid`` in the JSON."""

    classid: str
    options: JsonDict

    def to_json(self) -> JsonDict:
        return {"classid": self.classid, **self.options}


@dataclass(frozen=True, slots=True)
class MirredAction:
    eaction: int
    ifindex: int

    def to_json(self) -> JsonDict:
        return {"kind": "mirred", "eaction": self.eaction, "ifindex": self.ifindex}


@dataclass(frozen=True, slots=True)
class FilterView:
    kind: str
    pref: int
    protocol: str
    parent: str
    keys: tuple[str, ...]
    flowid: str | None = None
    action: MirredAction | None = None

    def to_json(self) -> JsonDict:
        out: JsonDict = {"kind": self.kind, "pref": self.pref, "protocol": self.protocol,
                         "parent": self.parent}
        if self.flowid is not None:
            out["flowid"] = self.flowid
        out["keys"] = list(self.keys)
        if self.action is not None:
            out["action"] = self.action.to_json()
        return out


@dataclass(frozen=True, slots=True)
class HopReadback:
    """What the kernel holds of one fault on one hop. An ifb hop names its ``ifb`` (whose
    qdiscs these are) and has no ``classes``; an htb hop has no ``ifb``."""

    netns: str | None
    ifname: str
    qdiscs: tuple[QdiscView, ...]
    filters: tuple[FilterView, ...]
    classes: tuple[ClassView, ...] | None = None
    ifb: str | None = None

    def to_json(self) -> JsonDict:
        out: JsonDict = {"netns": self.netns, "ifname": self.ifname}
        if self.ifb is not None:
            out["ifb"] = self.ifb
        out["qdiscs"] = [q.to_json() for q in self.qdiscs]
        if self.classes is not None:
            out["classes"] = [c.to_json() for c in self.classes]
        out["filters"] = [f.to_json() for f in self.filters]
        return out


@functools.cache
def psched_ns_per_tick() -> int:
    try:
        with open("/proc/net/psched") as fh:
            return int(fh.read().split()[1], 16)
    except (OSError, IndexError, ValueError):
        return 64  # PSCHED_SHIFT 6, unchanged since Linux 2.6.31


def _decode_htb(msg: Any) -> JsonDict:
    opts = msg.get_attr("TCA_OPTIONS")
    if opts is None:
        return {}
    init = opts.get_attr("TCA_HTB_INIT")
    if init is not None:
        return {"default": f"{init['defcls']:x}"}
    parms = opts.get_attr("TCA_HTB_PARMS") or {}
    return {"rate_bytes_per_s": opts.get_attr("TCA_HTB_RATE64") or parms.get("rate"),
            "ceil_bytes_per_s": opts.get_attr("TCA_HTB_CEIL64") or parms.get("ceil")}


def _decode_tbf(msg: Any) -> JsonDict:
    opts = msg.get_attr("TCA_OPTIONS")
    parms = opts.get_attr("TCA_TBF_PARMS") if opts is not None else None
    if not parms:
        return {}
    rate = parms["rate"]
    # buffer is the time the bucket takes to fill, in psched ticks.
    burst = parms["buffer"] * psched_ns_per_tick() * rate / 1e9
    return {"rate_bytes_per_s": rate, "burst_bytes": round(burst), "limit_bytes": parms["limit"]}


_DECODERS: dict[str, Decoder] = {"htb": _decode_htb, "tbf": _decode_tbf}


def describe_qdisc(msg: Any, decoders: dict[str, Decoder]) -> QdiscView:
    kind = msg.get_attr("TCA_KIND")
    decoder = decoders.get(kind) or _DECODERS.get(kind)
    stats = msg.get_attr("TCA_STATS")
    return QdiscView(
        kind=kind, handle=fmt_handle(msg["handle"]), parent=fmt_handle(msg["parent"]),
        options=decoder(msg) if decoder is not None else None,
        stats=None if stats is None else QdiscStats(bytes=stats["bytes"],
                                                    packets=stats["packets"],
                                                    drops=stats["drop"]))


def _u32_keys(sel: Any) -> tuple[str, ...]:
    """A dumped u32 selector's keys as ``tc filter show`` prints them ("val/mask at off").

    Read from the raw attribute: pyroute2 0.9.7 decodes the keys from the wrong offset.
    """
    raw = bytes(sel.data[sel.offset + 4: sel.offset + sel.length])
    keys = []
    for i in range(raw[2]):  # nkeys; each tc_u32_key is 16 bytes after the 16-byte selector
        mask, val = struct.unpack_from(">II", raw, 16 + 16 * i)
        (off,) = struct.unpack_from("=i", raw, 16 + 16 * i + 8)
        keys.append(f"{val:08x}/{mask:08x} at {off}")
    return tuple(keys)


def _mirred(opts: Any) -> MirredAction | None:
    """The (last) mirred action of a u32 filter's options, if it has one."""
    found = None
    act = opts.get_attr("TCA_U32_ACT")
    for _, action in (act or {}).get("attrs", []):
        if action.get_attr("TCA_ACT_KIND") == "mirred":
            parms = action.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
            found = MirredAction(eaction=parms["eaction"], ifindex=parms["ifindex"])
    return found


def describe_filter(msg: Any) -> FilterView:
    opts = msg.get_attr("TCA_OPTIONS")
    classid = opts.get_attr("TCA_U32_CLASSID")
    return FilterView(
        kind=msg.get_attr("TCA_KIND"), pref=filter_pref(msg),
        protocol=f"{socket.ntohs(int(msg['info']) & 0xFFFF):#06x}",
        parent=fmt_handle(msg["parent"]), keys=_u32_keys(opts.get_attr("TCA_U32_SEL")),
        flowid=fmt_handle(classid) if classid else None, action=_mirred(opts))


def _u32_nodes(ipr: IPRoute, index: int, parent: int, prefs: Sequence[int]) -> list[Any]:
    """The match nodes (not the hash-table headers) of our u32 filters at ``prefs``."""
    return [f for f in filters(ipr, index, parent)
            if filter_pref(f) in prefs and f.get_attr("TCA_OPTIONS") is not None
            and f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_SEL") is not None]


def _read_ifb_hop(ipr: IPRoute, index: int, st: HopState,
                  decoders: dict[str, Decoder]) -> HopReadback:
    assert st.ifb is not None, "read a hop back only once apply has planned it"
    ifb = link_index(ipr, st.netns, st.ifb)
    return HopReadback(
        netns=st.netns, ifname=st.ifname, ifb=st.ifb,
        qdiscs=tuple(describe_qdisc(q, decoders) for q in qdiscs(ipr, ifb)
                     if q["handle"] >> 16 in st.leaf_majors),
        filters=tuple(describe_filter(f) for f in
                      _u32_nodes(ipr, index, INGRESS_HANDLE, st.ingress_prefs)))


def read_hop(ipr: IPRoute, st: HopState, decoders: dict[str, Decoder]) -> HopReadback:
    """The kernel's own view of what this fault installed on one hop."""
    index = link_index(ipr, st.netns, st.ifname)
    if st.via_ifb:
        return _read_ifb_hop(ipr, index, st, decoders)
    assert st.class_minor is not None, "read a hop back only once apply has planned it"
    classid = ROOT_HANDLE | st.class_minor
    return HopReadback(
        netns=st.netns, ifname=st.ifname,
        qdiscs=tuple(describe_qdisc(q, decoders) for q in qdiscs(ipr, index)
                     if q["handle"] == ROOT_HANDLE or q["handle"] >> 16 in st.leaf_majors),
        classes=tuple(ClassView(classid=fmt_handle(c["handle"]), options=_decode_htb(c))
                      for c in classes(ipr, index) if c["handle"] in (classid, DEFAULT_CLASS)),
        filters=tuple(describe_filter(f) for f in
                      _u32_nodes(ipr, index, ROOT_HANDLE, st.prefs)))
