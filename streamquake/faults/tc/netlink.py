"""Netlink requests for tc, and the handles and filter prefs streamquake reserves.

The layout these numbers build is described in ``tc_scope``. Every request goes through
rtnetlink (pyroute2), never through the ``tc`` program.
"""

from __future__ import annotations

import socket
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST
from pyroute2.netlink.rtnl import (
    RTM_DELTFILTER,
    RTM_GETQDISC,
    RTM_GETTCLASS,
    RTM_GETTFILTER,
    TC_H_INGRESS,
    TC_H_ROOT,
)
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from streamquake.errors import InjectorError

ROOT_MAJOR = 0x5351
ROOT_HANDLE = ROOT_MAJOR << 16
DEFAULT_CLASS = ROOT_HANDLE | 0x1
FIRST_SHAPED_MINOR = 0x10
LEAF_MAJORS = range(0x5352, 0x5400)
PREF_TOP, PREF_FLOOR = 0x5350, 0x5300
INGRESS_HANDLE = 0xFFFF0000
IFB_PREFIX = "sqifb"
_ETH_P_ALL = 0x0003
MATCH_ALL = (_ETH_P_ALL, ["0x0/0x0+0"])


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


def del_filters(ipr: IPRoute, index: int, parent: int, pref: int) -> None:
    """Delete every filter at ``pref`` under ``parent`` (any protocol, any handle)."""
    _tc_request(ipr, RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK, index, parent, pref << 16)


def add_filters(ipr: IPRoute, index: int, parent: int, prefs: list[int],
                selectors: list[tuple[int, list[str]]], **extra: object) -> None:
    for pref, (proto, keys) in zip(prefs, selectors, strict=True):
        ipr.tc("add-filter", "u32", index=index, parent=parent, prio=pref, protocol=proto,
               keys=keys, **extra)


def qdisc_at(present: list[Any], parent: int) -> Any | None:
    return next((q for q in present if q["parent"] == parent), None)


def filter_pref(f: Any) -> int:
    return int(f["info"]) >> 16


def is_our_pref(pref: int) -> bool:
    return PREF_FLOOR <= pref <= PREF_TOP


def link_index(ipr: IPRoute, netns: str | None, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        where = f" in network namespace {netns}" if netns else ""
        raise InjectorError(f"interface {ifname!r} does not exist{where}; check network.interface")
    return int(found[0])
