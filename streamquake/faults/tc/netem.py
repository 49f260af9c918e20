"""netem: delay, jitter, loss, duplication, corruption, reordering and rate on the target's path.

The qdisc message is built here rather than by pyroute2's netem plugin (0.9.7), which cannot
send a delay distribution, turns ``rate=`` into the top-level TCA_RATE attribute, and knows only
32-bit tick delays. Here every parameter goes to the kernel in its own attribute (delays in
nanoseconds through TCA_NETEM_LATENCY64/JITTER64, the distribution table through
TCA_NETEM_DELAY_DIST loaded from iproute2's ``*.dist`` files), and ``apply`` reads the qdisc
back and refuses to report success unless the kernel holds what was configured. The kernel
does not dump distribution tables, so for those the read-back shows the table that was sent.

A netem fault on a run whose ``network.profile`` is set lands on top of the profile: delays add,
jitters add in quadrature, losses combine as independent events. A fault that names a
``profile`` itself replaces the path's profile while it is applied.
"""

from __future__ import annotations

import glob
import hashlib
import os
import socket
import struct
import sysconfig
from pathlib import Path
from typing import Any, TypedDict

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, nla, nlmsg
from pyroute2.netlink.rtnl import RTM_NEWQDISC

from streamquake.errors import InjectorError
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.install import LeafQdisc
from streamquake.faults.tc.readback import psched_ns_per_tick
from streamquake.faults.tc.scope import ScopedTc
from streamquake.faults.tc.spec import NetemFault, network_profile_fault
from streamquake.journal import JournalEntry
from streamquake.jsontypes import JsonDict, JsonValue

_U32 = 0xFFFFFFFF
_DIST_MAX = 16384  # NETEM_DIST_MAX in the kernel


def _u32(frac: float) -> int:
    return round(frac * _U32)


# ---------------------------------------------------------------------------- distribution tables


def table_dirs() -> list[Path]:
    """Where iproute2 keeps its netem tables (as ``tc`` looks: $TC_LIB_DIR first)."""
    dirs = [os.environ.get("TC_LIB_DIR", "")]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs.append(f"/usr/lib/{multiarch}/tc")
    dirs += ["/usr/lib/tc", "/usr/lib64/tc", "/usr/local/lib/tc", *glob.glob("/usr/lib/*/tc")]
    return [Path(d) for d in dict.fromkeys(dirs) if d]


def load_table(name: str) -> list[int]:
    """A netem delay distribution table: signed 16-bit values in units of jitter / 8192."""
    for d in table_dirs():
        path = d / f"{name}.dist"
        if path.is_file():
            values = [int(tok) for line in path.read_text().splitlines()
                      if not line.lstrip().startswith("#") for tok in line.split()]
            if not 0 < len(values) <= _DIST_MAX:
                raise InjectorError(f"{path} holds {len(values)} values; netem takes 1 to "
                                    f"{_DIST_MAX}")
            return values
    searched = ", ".join(str(d) for d in table_dirs())
    raise InjectorError(
        f"netem distribution {name!r} needs iproute2's table {name}.dist, which is not in "
        f"{searched}: install iproute2 (it ships the tables) or set TC_LIB_DIR to a directory "
        f"holding {name}.dist"
    )


# ---------------------------------------------------------------------------- netlink message


class netem_qdisc_msg(nlmsg):  # type: ignore[misc]
    """A tc qdisc message whose netem options carry every attribute netem knows."""

    prefix = "TCA_"
    fields = (
        ("family", "B"), ("pad1", "B"), ("pad2", "H"), ("index", "i"),
        ("handle", "I"), ("parent", "I"), ("info", "I"),
    )
    nla_map = (
        ("TCA_UNSPEC", "none"),
        ("TCA_KIND", "asciiz"),
        ("TCA_OPTIONS", "netem_options"),
    )

    class netem_options(nla):  # type: ignore[misc]
        # struct tc_netem_qopt, then attributes (netem's own "nested after a struct" layout).
        fields = (
            ("latency", "I"), ("limit", "I"), ("loss", "I"),
            ("gap", "I"), ("duplicate", "I"), ("jitter", "I"),
        )
        nla_map = (
            (1, "TCA_NETEM_CORR", "corr"),
            (2, "TCA_NETEM_DELAY_DIST", "cdata"),
            (3, "TCA_NETEM_REORDER", "pair"),
            (4, "TCA_NETEM_CORRUPT", "pair"),
            (6, "TCA_NETEM_RATE", "rate"),
            (8, "TCA_NETEM_RATE64", "uint64"),
            (10, "TCA_NETEM_LATENCY64", "int64"),
            (11, "TCA_NETEM_JITTER64", "int64"),
        )

        class corr(nla):  # type: ignore[misc]
            fields = (("delay_corr", "I"), ("loss_corr", "I"), ("dup_corr", "I"))

        class pair(nla):  # type: ignore[misc]
            fields = (("probability", "I"), ("correlation", "I"))

        class rate(nla):  # type: ignore[misc]
            fields = (("rate", "I"), ("packet_overhead", "i"), ("cell_size", "I"),
                      ("cell_overhead", "i"))


class NetemOptions(TypedDict):
    """netem's TCA_OPTIONS as netem_qdisc_msg sends them: struct tc_netem_qopt's fields (delays
    in psched ticks), then ``attrs``, pyroute2's ``[name, value]`` pairs."""

    latency: int
    jitter: int
    limit: int
    loss: int
    gap: int
    duplicate: int
    attrs: list[list[Any]]


def kernel_options(f: NetemFault, table: list[int] | None) -> NetemOptions:
    """``f`` in the kernel's units and attributes (what netem_change() parses)."""
    delay_ns, jitter_ns = round(f.delay_ms * 1e6), round(f.jitter_ms * 1e6)
    tick = psched_ns_per_tick()
    gap = f.gap or (1 if f.reorder else 0)  # as tc does: reordering needs a gap of at least 1
    attrs: list[list[Any]] = [
        ["TCA_NETEM_LATENCY64", delay_ns],
        ["TCA_NETEM_JITTER64", jitter_ns],
        ["TCA_NETEM_CORR", {"delay_corr": _u32(f.correlation),
                            "loss_corr": _u32(f.loss_correlation),
                            "dup_corr": _u32(f.duplicate_correlation)}],
        ["TCA_NETEM_REORDER", {"probability": _u32(f.reorder),
                               "correlation": _u32(f.reorder_correlation)}],
        ["TCA_NETEM_CORRUPT", {"probability": _u32(f.corrupt),
                               "correlation": _u32(f.corrupt_correlation)}],
    ]
    if f.rate_bytes_per_s:
        rate = round(f.rate_bytes_per_s)
        attrs.append(["TCA_NETEM_RATE", {"rate": min(rate, _U32), "packet_overhead": 0,
                                         "cell_size": 0, "cell_overhead": 0}])
        if rate > _U32:
            attrs.append(["TCA_NETEM_RATE64", rate])
    if table is not None:
        attrs.append(["TCA_NETEM_DELAY_DIST", struct.pack(f"={len(table)}h", *table)])
    return {
        "latency": min(delay_ns // tick, _U32), "jitter": min(jitter_ns // tick, _U32),
        "limit": f.limit, "loss": _u32(f.loss), "gap": gap, "duplicate": _u32(f.duplicate),
        "attrs": attrs,
    }


def add_netem(ipr: IPRoute, index: int, parent: int, handle: int, options: NetemOptions) -> None:
    msg = netem_qdisc_msg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = index
    msg["handle"] = handle
    msg["parent"] = parent
    msg["attrs"] = [["TCA_KIND", "netem"], ["TCA_OPTIONS", options]]
    tuple(ipr.nlm_request(msg, RTM_NEWQDISC,
                          NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL))


def decode_netem(msg: Any) -> JsonDict:
    """The kernel's netem parameters from a dumped qdisc, in kernel units."""
    ours = netem_qdisc_msg(data=msg.data, offset=msg.offset)
    ours.decode()
    opts = ours.get_attr("TCA_OPTIONS")
    corr = opts.get_attr("TCA_NETEM_CORR") or {}
    reorder = opts.get_attr("TCA_NETEM_REORDER") or {}
    corrupt = opts.get_attr("TCA_NETEM_CORRUPT") or {}
    rate = opts.get_attr("TCA_NETEM_RATE") or {}
    tick = psched_ns_per_tick()
    latency = opts.get_attr("TCA_NETEM_LATENCY64")
    jitter = opts.get_attr("TCA_NETEM_JITTER64")
    return {
        "delay_ns": latency if latency is not None else opts["latency"] * tick,
        "jitter_ns": jitter if jitter is not None else opts["jitter"] * tick,
        "limit": opts["limit"], "loss": opts["loss"], "gap": opts["gap"],
        "duplicate": opts["duplicate"],
        "delay_corr": corr.get("delay_corr", 0), "loss_corr": corr.get("loss_corr", 0),
        "dup_corr": corr.get("dup_corr", 0),
        "reorder": reorder.get("probability", 0), "reorder_corr": reorder.get("correlation", 0),
        "corrupt": corrupt.get("probability", 0), "corrupt_corr": corrupt.get("correlation", 0),
        "rate_bytes_per_s": opts.get_attr("TCA_NETEM_RATE64") or rate.get("rate", 0),
    }


def expected_view(opts: NetemOptions) -> dict[str, int]:
    """What decode_netem() must return for a qdisc installed with ``opts``."""
    a = {name: value for name, value in opts["attrs"]}
    rate = a.get("TCA_NETEM_RATE64") or a.get("TCA_NETEM_RATE", {}).get("rate", 0)
    return {
        "delay_ns": a["TCA_NETEM_LATENCY64"], "jitter_ns": a["TCA_NETEM_JITTER64"],
        "limit": opts["limit"], "loss": opts["loss"], "gap": opts["gap"],
        "duplicate": opts["duplicate"], **a["TCA_NETEM_CORR"],
        "reorder": a["TCA_NETEM_REORDER"]["probability"],
        "reorder_corr": a["TCA_NETEM_REORDER"]["correlation"],
        "corrupt": a["TCA_NETEM_CORRUPT"]["probability"],
        "corrupt_corr": a["TCA_NETEM_CORRUPT"]["correlation"],
        "rate_bytes_per_s": rate,
    }


def _number(value: JsonValue) -> float:
    """A read-back value as a number (one that is missing or not a number counts as 0)."""
    return value if isinstance(value, int | float) else 0


# ---------------------------------------------------------------------------- the injector


class NetemInjector:
    type_name = "netem"

    def __init__(self, spec: NetemFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        base = network_profile_fault(ctx.network) if spec.profile is None else None
        self.base_profile = base.profile if base else None
        self.effective = spec.over(base) if base else spec
        self._options: NetemOptions | None = None
        self._table_sha256: str | None = None
        self._tc = ScopedTc(ctx, spec, [LeafQdisc("netem", self._add)], {"netem": decode_netem})

    def _add(self, ipr: IPRoute, index: int, parent: int, handle: int) -> None:
        assert self._options is not None
        add_netem(ipr, index, parent, handle, self._options)

    def _prepare(self) -> NetemOptions:
        table = None
        if self.effective.distribution:
            table = load_table(self.effective.distribution)
            self._table_sha256 = hashlib.sha256(struct.pack(f"={len(table)}h", *table)).hexdigest()
        self._options = kernel_options(self.effective, table)
        return self._options

    def preflight(self) -> list[str]:
        problems = self._tc.preflight()
        if self.effective.distribution:
            try:
                load_table(self.effective.distribution)
            except InjectorError as exc:
                problems.append(str(exc))
        return problems

    def apply(self, entry: JournalEntry) -> JsonDict:
        opts = self._prepare()
        applied = self._tc.apply(entry)
        want = expected_view(opts)
        # Kernels before 4.15 report delays in psched ticks only: allow that rounding.
        slack = {"delay_ns": psched_ns_per_tick(), "jitter_ns": psched_ns_per_tick()}
        for hop in applied.kernel:
            got = [q.options or {} for q in hop.qdiscs if q.kind == "netem"]
            diff = {k: (v, got[0].get(k)) for k, v in want.items()
                    if got and abs(_number(got[0].get(k)) - v) > slack.get(k, 0)}
            if not got or diff:
                self.revert()
                raise InjectorError(
                    f"the kernel does not hold the netem parameters that were sent on "
                    f"{hop.ifname} (sent vs read back: {diff or 'no netem qdisc found'}); "
                    "the fault was reverted"
                )
        return applied.to_json()   # the configured view is describe()'s, in the record once

    def revert(self) -> JsonDict:
        return self._tc.revert()

    def describe(self) -> JsonDict:
        f = self.effective
        placement = self._tc.placement
        view: JsonDict = {
            "type": "netem", "name": self.spec.label, "delay_ms": f.delay_ms,
            "jitter_ms": f.jitter_ms, "correlation": f.correlation,
            "distribution": f.distribution or ("uniform" if f.jitter_ms else None),
            "loss": f.loss, "loss_correlation": f.loss_correlation, "duplicate": f.duplicate,
            "corrupt": f.corrupt, "reorder": f.reorder, "gap": f.gap,
            "rate_bytes_per_s": f.rate_bytes_per_s, "limit": f.limit,
            "scope": placement.scope, "direction": placement.direction,
            "interface": placement.interface, "profile": self.spec.profile,
            "over_network_profile": self.base_profile,
        }
        if self._table_sha256:
            # The kernel keeps but never dumps the table: this is the one that was sent.
            view["distribution_table_sha256"] = self._table_sha256
        return view

    @classmethod
    def recover(cls, state: dict[str, object]) -> str:
        return "netem fault: " + ScopedTc.recover(state)
