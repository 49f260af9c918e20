"""Removing what a tc fault installed, from its journal state alone (so ``recover`` can too),
and checking that none of it is left."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ParamSpec

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import TC_H_INGRESS, TC_H_ROOT

from streamquake.deadline import run_with_deadline
from streamquake.errors import RevertError
from streamquake.faults.tc.netlink import (
    DEFAULT_CLASS,
    INGRESS_HANDLE,
    ROOT_HANDLE,
    classes,
    del_filters,
    filter_pref,
    filters,
    fmt_handle,
    qdisc_at,
    qdiscs,
)
from streamquake.faults.tc.netns import iproute, is_gone, netns_exists
from streamquake.faults.tc.state import HopState

_EINVAL = 22
P = ParamSpec("P")


def _step(removed: list[str], what: str, fn: Callable[P, object], *args: P.args,
          **kwargs: P.kwargs) -> None:
    """One removal step; an object that is already gone is not an error."""
    try:
        fn(*args, **kwargs)
    except NetlinkError as exc:
        if is_gone(exc) or exc.code == _EINVAL:  # EINVAL: no filter at that pref any more
            return
        raise
    removed.append(what)


def _remove_htb(ipr: IPRoute, index: int, st: HopState, removed: list[str]) -> None:
    root = qdisc_at(qdiscs(ipr, index), TC_H_ROOT)
    if root is None or root["handle"] != ROOT_HANDLE or root.get_attr("TCA_KIND") != "htb":
        return  # not ours (any more): nothing of ours can hang below it
    dev = st.ifname
    for pref in st.prefs:
        _step(removed, f"filter pref {pref} on {dev}", del_filters, ipr, index, ROOT_HANDLE,
              pref)
    if st.class_minor is not None:
        classid = ROOT_HANDLE | st.class_minor
        # Deleting the class deletes the leaf qdiscs hanging from it.
        _step(removed, f"class {fmt_handle(classid)} and its qdiscs on {dev}", ipr.tc,
              "del-class", None, index, classid, parent=ROOT_HANDLE)
    shaped = [c for c in classes(ipr, index) if c["handle"] != DEFAULT_CLASS]
    if not shaped and not filters(ipr, index, ROOT_HANDLE):
        _step(removed, f"root qdisc 5351: on {dev}", ipr.tc, "del", None, index, ROOT_HANDLE,
              parent=TC_H_ROOT)


def _remove_ingress(ipr: IPRoute, index: int, st: HopState, removed: list[str]) -> None:
    dev = st.ifname
    for pref in st.ingress_prefs:
        _step(removed, f"ingress filter pref {pref} on {dev}", del_filters, ipr, index,
              INGRESS_HANDLE, pref)
    ingress = qdisc_at(qdiscs(ipr, index), TC_H_INGRESS)
    if (ingress is not None and ingress.get_attr("TCA_KIND") == "ingress"
            and st.ingress_owned and not filters(ipr, index, INGRESS_HANDLE)):
        _step(removed, f"ingress qdisc on {dev}", ipr.tc, "del", "ingress", index,
              INGRESS_HANDLE)


def _leaf_place(ipr: IPRoute, st: HopState) -> tuple[str, int, int] | None:
    """(device, its index, parent) where a leaf-only hop's top leaf hangs; None if gone."""
    dev = st.ifb if st.via_ifb else st.ifname
    found = ipr.link_lookup(ifname=dev) if dev else []
    if not found or not st.leaf_majors:
        return None
    parent = TC_H_ROOT if st.via_ifb else ROOT_HANDLE | (st.class_minor or 0)
    return dev or "", int(found[0]), parent


def remove_leaf(ipr: IPRoute, st: HopState, removed: list[str]) -> None:
    """Delete a leaf-only hop's top leaf (those under it go with it). The kernel checks the
    handle at that parent (EINVAL when another leaf is there now), so nothing else goes."""
    place = _leaf_place(ipr, st)
    if place is not None:
        dev, index, parent = place
        handle = st.leaf_majors[0] << 16
        _step(removed, f"qdisc {fmt_handle(handle)} on {dev}", ipr.tc, "del", None, index,
              handle, parent=parent)


def leaf_leftovers(ipr: IPRoute, st: HopState) -> list[str]:
    place = _leaf_place(ipr, st)
    if place is None:
        return []
    dev, index, _ = place
    return [f"qdisc {fmt_handle(q['handle'])} on {dev}" for q in qdiscs(ipr, index)
            if q["handle"] >> 16 in st.leaf_majors]


def _remove_hop(st: HopState) -> list[str]:
    removed: list[str] = []
    if st.netns and not netns_exists(st.netns):
        return removed  # the namespace is gone, and everything in it
    with iproute(st.netns) as ipr:
        if st.leaf_only:
            remove_leaf(ipr, st, removed)
            return removed
        found = ipr.link_lookup(ifname=st.ifname)
        if found and st.via_ifb:
            _remove_ingress(ipr, found[0], st, removed)
        elif found:
            _remove_htb(ipr, found[0], st, removed)
        ifb = ipr.link_lookup(ifname=st.ifb) if st.ifb else []
        if ifb:
            _step(removed, f"ifb {st.ifb}", ipr.link, "del", index=ifb[0])
    return removed


def leftovers(st: HopState) -> list[str]:
    """This hop's own objects still in the kernel (none after a good revert)."""
    if st.netns and not netns_exists(st.netns):
        return []
    with iproute(st.netns) as ipr:
        if st.leaf_only:
            return leaf_leftovers(ipr, st)
        left = [f"ifb {st.ifb}"] if st.ifb and ipr.link_lookup(ifname=st.ifb) else []
        found = ipr.link_lookup(ifname=st.ifname)
        if not found:
            return left
        index = found[0]
        if st.via_ifb:
            return left + [f"ingress filter pref {filter_pref(f)}" for f in
                           filters(ipr, index, INGRESS_HANDLE)
                           if filter_pref(f) in st.ingress_prefs]
        present = qdiscs(ipr, index)
        root = qdisc_at(present, TC_H_ROOT)
        if root is None or root["handle"] != ROOT_HANDLE:
            return left
        left += [f"filter pref {filter_pref(f)}" for f in filters(ipr, index, ROOT_HANDLE)
                 if filter_pref(f) in st.prefs]
        return left + [f"qdisc {fmt_handle(q['handle'])}" for q in present
                       if q["handle"] >> 16 in st.leaf_majors]


def remove_hops(hops: Sequence[HopState], timeout_s: float) -> list[str]:
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
        where = ", ".join(h.ifname + (f" (netns {h.netns})" if h.netns else "") for h in hops)
        raise RevertError(
            f"could not revert the tc fault on {where}: {exc}. It may still be in place: run "
            "`streamquake recover`, or remove it by hand (`tc qdisc del dev IFACE root` where "
            "the root is htb 5351:, `ip link del sqifb...`)"
        ) from exc
