"""Preflight for tc faults: CAP_NET_ADMIN, and which qdiscs, filters and devices this kernel has.

Probed for real in a throwaway network namespace, once per process.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from typing import ParamSpec

from pyroute2 import netns as pr_netns
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import TC_H_ROOT

from streamquake.faults.tc.netlink import (
    DEFAULT_CLASS,
    INGRESS_HANDLE,
    MATCH_ALL,
    PREF_TOP,
    ROOT_HANDLE,
    add_filters,
)
from streamquake.faults.tc.netns import has_cap_net_admin, iproute

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


P = ParamSpec("P")


def _works(fn: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> bool:
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
                if _works(add_filters, ipr, lo, ROOT_HANDLE, [PREF_TOP], [MATCH_ALL],
                          target=DEFAULT_CLASS):
                    found.add("u32")
            if (_works(ipr.link, "add", ifname="sqprobeifb", kind="ifb")
                    and _works(ipr.tc, "add", "ingress", lo, INGRESS_HANDLE)):
                ifb = ipr.link_lookup(ifname="sqprobeifb")[0]
                redirect = {"kind": "mirred", "direction": "egress", "action": "redirect",
                            "ifindex": ifb}
                if _works(add_filters, ipr, lo, INGRESS_HANDLE, [PREF_TOP], [MATCH_ALL],
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
