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

The parts, with imports flowing one way: ``netlink`` (requests, and the reserved handles and
prefs above) underlies ``placement`` (hops, u32 selectors), ``state`` (``HopState``: what a hop
holds, as the journal keeps it), ``readback`` (the kernel's view, ``HopReadback``), ``probe``
(preflight), ``install`` (ownership checks, install; it takes ``placement``'s Hop and hands back
the ``HopState`` it planned) and ``remove`` (from ``HopState`` alone); ``scaffold`` builds the
tree once for a run (a ``resources.TcScaffold``), and a fault on a run with one adds and removes
only its leaves there. Only this module ties them into one fault; none of them imports it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyroute2.netlink.exceptions import NetlinkError

from streamquake.deadline import run_with_deadline
from streamquake.errors import InjectorError, RevertError
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.install import LeafQdisc, install_htb, install_ifb, ownership_problem
from streamquake.faults.tc.netns import iproute, netns_exists
from streamquake.faults.tc.placement import (
    Hop,
    plan_hops,
    resolve_addresses,
    resolve_placement,
    u32_selectors,
)
from streamquake.faults.tc.probe import capability_problems
from streamquake.faults.tc.readback import Decoder, HopReadback, read_hop
from streamquake.faults.tc.remove import remove_hops
from streamquake.faults.tc.resources import TcScaffold
from streamquake.faults.tc.scaffold import Scaffold, Slot
from streamquake.faults.tc.spec import TcPlacement
from streamquake.faults.tc.state import HopState, hops_from_json
from streamquake.journal import JournalEntry
from streamquake.jsontypes import JsonDict
from streamquake.killpoints import killpoint


@dataclass(frozen=True, slots=True)
class TcApplied:
    """What ``ScopedTc.apply`` did: the hops (as journalled), the kernel's read-back of each,
    and how long it took."""

    hops: tuple[HopState, ...]
    kernel: tuple[HopReadback, ...]
    apply_ms: float

    def to_json(self) -> JsonDict:
        return {"hops": [h.to_json() for h in self.hops],
                "kernel": [k.to_json() for k in self.kernel], "apply_ms": self.apply_ms}


def _claim_key(hop: Hop) -> str:
    return f"tc:{hop.netns or 'host'}:{hop.ifname}:{'ingress' if hop.via_ifb else 'egress'}"


def _claim_words(hop: Hop) -> str:
    where = f" in network namespace {hop.netns}" if hop.netns else ""
    what = "ingress redirect (ifb)" if hop.via_ifb else "egress qdisc tree"
    return f"the {what} of {hop.ifname}{where}"


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
        self._hops: list[HopState] = []
        self._on: tuple[Scaffold, list[Slot]] | None = None  # applied on the run's scaffold

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
                    problem = ownership_problem(ipr, hop)
                if problem:
                    problems.append(problem)
        except InjectorError as exc:
            problems.append(str(exc))
        except (NetlinkError, OSError) as exc:
            problems.append(f"cannot find the route to the target {self.ctx.target_host}: {exc}")
        return problems

    def apply(self, entry: JournalEntry) -> TcApplied:
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
        return TcApplied(tuple(self._hops), self.read_back(), apply_ms)

    def _apply(self, entry: JournalEntry) -> None:
        resource = self.ctx.find(TcScaffold)
        scaffold = resource.scaffold if resource is not None else None
        slots = scaffold.slots(self.placement) if scaffold is not None else None
        if scaffold is not None and slots:
            self._apply_on(scaffold, slots, entry)
            return
        hops = plan_hops(self.ctx, self.placement)
        addrs = resolve_addresses(self.ctx.target_host)
        # One owner per interface and direction: another's newest filter would take this
        # fault's packets mid-phase. One run's own faults stack (newest first, each revert
        # removing only its own), as a whole-run profile under a phase fault does.
        entry.claim({_claim_key(h): _claim_words(h) for h in hops}, per_owner=True)
        for hop in hops:
            self._hops.append(HopState.bare(hop))
            install = install_ifb if hop.via_ifb else install_htb
            with iproute(hop.netns) as ipr:
                install(ipr, hop, self.leaves,
                        u32_selectors(addrs, self.ctx.target_port, hop.match),
                        lambda st: self._record(entry, st))
        killpoint("tc.installed")

    def _apply_on(self, scaffold: Scaffold, slots: list[Slot], entry: JournalEntry) -> None:
        """The run's scaffold holds the classes and filters: add only the leaves."""
        entry.claim({_claim_key(s.hop): _claim_words(s.hop) for s in slots}, per_owner=True)
        self._on = (scaffold, slots)
        self._hops = [scaffold.plan(self, slot, self.leaves) for slot in slots]
        entry.save({"hops": [h.to_json() for h in self._hops]})
        killpoint("tc.journalled")
        for slot in slots:
            scaffold.put(self, slot)
        killpoint("tc.installed")

    def _record(self, entry: JournalEntry, st: HopState) -> None:
        """The hop being installed is now ``st``: journal every hop before it changes anything."""
        self._hops[-1] = st
        entry.save({"hops": [h.to_json() for h in self._hops]})
        killpoint("tc.journalled")

    def hop_states(self) -> list[HopState]:
        return list(self._hops)

    def read_back(self) -> tuple[HopReadback, ...]:
        if self._on is not None:
            scaffold, slots = self._on
            return tuple(scaffold.read(self, slot, self.decoders) for slot in slots)
        views = []
        for st in self._hops:
            with iproute(st.netns) as ipr:
                views.append(read_hop(ipr, st, self.decoders))
        return tuple(views)

    def revert(self) -> JsonDict:
        """Remove what apply installed; idempotent, and fine after a partial apply."""
        started = time.perf_counter()
        if self._on is not None:
            removed = self._revert_on(*self._on)
        else:
            removed = remove_hops(self._hops, self.revert_timeout_s) if self._hops else []
        self._hops, self._on = [], None
        return {"removed": list(removed), "revert_ms": (time.perf_counter() - started) * 1000}

    def _revert_on(self, scaffold: Scaffold, slots: list[Slot]) -> list[str]:
        try:
            return run_with_deadline(
                lambda: [x for slot in reversed(slots) for x in scaffold.take(self, slot)],
                self.revert_timeout_s, "reverting the tc fault")
        except (NetlinkError, OSError, TimeoutError) as exc:
            raise RevertError(
                f"could not revert the tc fault's leaves on the run's scaffold: {exc}. It may "
                "still be in place until the run ends; else run `streamquake recover`") from exc

    @classmethod
    def recover(cls, state: Mapping[str, object]) -> str:
        """Undo a fault from its journal state alone (``{"hops": [...]}``, any version's)."""
        removed = remove_hops(hops_from_json(state.get("hops")), cls.revert_timeout_s)
        return ("removed " + "; ".join(removed)) if removed else "nothing of it was left"
