"""The kernel's own view of an installed tc fault: dumped qdiscs, classes and u32 filters,
decoded into plain dicts for the fault's ``kernel`` read-back."""

from __future__ import annotations

import functools
import socket
import struct
from collections.abc import Callable, Sequence
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

Decoder = Callable[[Any], dict[str, Any]]


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
    view: dict[str, Any] = {"kind": msg.get_attr("TCA_KIND"), "pref": filter_pref(msg),
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
            if filter_pref(f) in prefs and f.get_attr("TCA_OPTIONS") is not None
            and f.get_attr("TCA_OPTIONS").get_attr("TCA_U32_SEL") is not None]


def read_hop(ipr: IPRoute, st: dict[str, Any], decoders: dict[str, Decoder]) -> dict[str, Any]:
    """The kernel's own view of what this fault installed on one hop."""
    index = link_index(ipr, st.get("netns"), st["ifname"])
    view: dict[str, Any] = {"netns": st.get("netns"), "ifname": st["ifname"]}
    majors = st["leaf_majors"]
    if st.get("via_ifb"):
        ifb = link_index(ipr, st.get("netns"), st["ifb"])
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
