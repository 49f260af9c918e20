"""Installing a fault's htb class, leaf qdiscs and u32 filters on one hop, and the ownership
checks that keep streamquake off qdiscs it did not install (the rules are in ``scope``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.rtnl import TC_H_INGRESS, TC_H_ROOT

from streamquake.errors import InjectorError
from streamquake.faults.tc.netlink import (
    DEFAULT_CLASS,
    FIRST_SHAPED_MINOR,
    IFB_PREFIX,
    INGRESS_HANDLE,
    LEAF_MAJORS,
    PREF_FLOOR,
    PREF_TOP,
    ROOT_HANDLE,
    add_filters,
    classes,
    filter_pref,
    filters,
    fmt_handle,
    is_our_pref,
    link_index,
    qdisc_at,
    qdiscs,
)
from streamquake.faults.tc.placement import Hop
from streamquake.faults.tc.state import HopState

# "Unshaped": far above what any interface here carries, so htb never holds a packet back.
UNSHAPED_BYTES_PER_S = 100_000_000_000 // 8
_HTB_QUANTUM = 60_000


@dataclass(frozen=True)
class LeafQdisc:
    """A qdisc the fault supplies: ``add(ipr, ifindex, parent, handle)`` installs it."""

    kind: str
    add: Callable[[IPRoute, int, int, int], None]


# ---------------------------------------------------------------------------- ownership


def _foreign_root(present: list[Any], hop: Hop) -> str | None:
    root = qdisc_at(present, TC_H_ROOT)
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
    ingress = qdisc_at(present, TC_H_INGRESS)
    if ingress is None:
        return None
    kind = ingress.get_attr("TCA_KIND")
    if kind == "ingress" and all(is_our_pref(filter_pref(f))
                                 for f in filters(ipr, index, INGRESS_HANDLE)):
        return None
    where = f" -n {hop.netns}" if hop.netns else ""
    return (
        f"interface {hop.ifname} already has an {kind} qdisc with filters that streamquake did "
        f"not install, and shaping the target's answers would need it; remove it with "
        f"`tc{where} qdisc del dev {hop.ifname} {kind}`, or use direction: egress"
    )


def ownership_problem(ipr: IPRoute, hop: Hop) -> str | None:
    index = link_index(ipr, hop.netns, hop.ifname)
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
    ours = [p for p in in_use if is_our_pref(p)]
    top = min(ours) - 1 if ours else PREF_TOP
    if top - n + 1 < PREF_FLOOR:
        raise InjectorError("too many streamquake filters on one interface; revert some faults")
    return list(range(top, top - n, -1))


def _add_unshaped_class(ipr: IPRoute, index: int, classid: int) -> None:
    ipr.tc("add-class", "htb", index=index, handle=classid, parent=ROOT_HANDLE,
           rate=UNSHAPED_BYTES_PER_S, ceil=UNSHAPED_BYTES_PER_S, quantum=_HTB_QUANTUM)


def add_chain(ipr: IPRoute, index: int, parent: int, leaves: Sequence[LeafQdisc],
               majors: list[int]) -> None:
    for leaf, major in zip(leaves, majors, strict=True):
        leaf.add(ipr, index, parent, major << 16)
        parent = (major << 16) | 1  # the next leaf hangs under this one's single class


def install_htb(ipr: IPRoute, hop: Hop, leaves: Sequence[LeafQdisc],
                selectors: list[tuple[int, list[str]]], record: Callable[[HopState], None]
                ) -> None:
    """Plan our class, leaf handles and prefs on ``hop``, ``record`` them, then install."""
    index = link_index(ipr, hop.netns, hop.ifname)
    present = qdiscs(ipr, index)
    problem = _foreign_root(present, hop)
    if problem:
        raise InjectorError(problem)
    root = qdisc_at(present, TC_H_ROOT)
    ours = root is not None and root["handle"] == ROOT_HANDLE
    minors = {c["handle"] & 0xFFFF for c in classes(ipr, index)} if ours else set()
    minor = _free(range(FIRST_SHAPED_MINOR, 0xFFFF), minors, 1, "class id")[0]
    majors = _free(LEAF_MAJORS, {q["handle"] >> 16 for q in present}, len(leaves),
                   "qdisc handle")
    prefs = _new_prefs({filter_pref(f) for f in filters(ipr, index, ROOT_HANDLE)} if ours
                       else set(), len(selectors))
    record(replace(HopState.bare(hop), class_minor=minor, leaf_majors=tuple(majors),
                   prefs=tuple(prefs)))  # all that recover needs is on disk before any change
    if not ours:
        ipr.tc("add", "htb", index=index, handle=ROOT_HANDLE, parent=TC_H_ROOT, default=1)
    if 1 not in minors:
        _add_unshaped_class(ipr, index, DEFAULT_CLASS)
    classid = ROOT_HANDLE | minor
    _add_unshaped_class(ipr, index, classid)
    add_chain(ipr, index, classid, leaves, majors)
    add_filters(ipr, index, ROOT_HANDLE, prefs, selectors, target=classid)


def install_ifb(ipr: IPRoute, hop: Hop, leaves: Sequence[LeafQdisc],
                selectors: list[tuple[int, list[str]]], record: Callable[[HopState], None]
                ) -> None:
    """Plan an ifb, leaf handles and ingress prefs on ``hop``, ``record`` them, then install."""
    index = link_index(ipr, hop.netns, hop.ifname)
    present = qdiscs(ipr, index)
    problem = _foreign_ingress(ipr, index, present, hop)
    if problem:
        raise InjectorError(problem)
    in_use = {filter_pref(f) for f in filters(ipr, index, INGRESS_HANDLE)}
    has_ingress = qdisc_at(present, TC_H_INGRESS) is not None
    ifb_name = f"{IFB_PREFIX}{uuid.uuid4().hex[:8]}"
    majors = list(LEAF_MAJORS[: len(leaves)])
    prefs = _new_prefs(in_use, len(selectors))
    record(replace(
        HopState.bare(hop), ifb=ifb_name, leaf_majors=tuple(majors), ingress_prefs=tuple(prefs),
        # An ingress qdisc we create, or one whose filters are all ours, is ours to remove later.
        ingress_owned=not has_ingress or bool(in_use)))
    ipr.link("add", ifname=ifb_name, kind="ifb")
    ifb = ipr.link_lookup(ifname=ifb_name)[0]
    ipr.link("set", index=ifb, state="up")
    add_chain(ipr, ifb, TC_H_ROOT, leaves, majors)
    if not has_ingress:
        ipr.tc("add", "ingress", index=index, handle=INGRESS_HANDLE)
    add_filters(ipr, index, INGRESS_HANDLE, prefs, selectors, target=0,
                action={"kind": "mirred", "direction": "egress", "action": "redirect",
                        "ifindex": ifb})
