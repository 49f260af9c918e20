"""The run-long scoping scaffold: our htb root, one shaped class and its u32 filters on each
interface the run's tc faults shape (an ifb, the ingress qdisc and its filters where answers are
shaped as they arrive), built once when the run starts. A fault on the run then adds only its
leaf qdiscs under a slot's class (or at the ifb's root), and its revert deletes only those: two
netlink requests and one read-back instead of about thirty (benchmarks/tc_apply_revert.py).

A class with no leaf of ours passes packets unshaped (the kernel hangs a default pfifo on it),
so an idle slot is the same path as no fault at all. One slot per interface and direction (the
claim key): a slot with no leaf still takes the packets its filters match, so a second slot on
the same interface would hide the first; where the run's faults want different matches on one
interface, that interface gets no slot and its faults install their own tree as without a run.

Faults stack on a slot as they do on their own classes: the newest fault's leaves are the ones
in place (every fault's leaves already hold the network profile under them), and reverting it
puts back the leaves of the one it covered. Between deleting the covered leaf and adding the new
one the class passes packets unshaped, for the time of one request.

The scaffold is journalled as its own entry (type ``tc_scaffold``, ``{"hops": [...]}``, the same
hop state a fault keeps) before it changes anything, so ``recover`` and the agent's watchdog
remove it after a kill like any fault's tree; each fault's entry holds only its leaves
(``HopState.leaf_only``). One netlink socket per namespace stays open for the run.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import TC_H_ROOT

from streamquake.errors import InjectorError, RevertError
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.install import LeafQdisc, add_chain, install_htb, install_ifb
from streamquake.faults.tc.netlink import LEAF_MAJORS, ROOT_HANDLE, ROOT_MAJOR, link_index, qdiscs
from streamquake.faults.tc.netns import iproute
from streamquake.faults.tc.placement import (
    Hop,
    Placement,
    plan_hops,
    resolve_addresses,
    u32_selectors,
)
from streamquake.faults.tc.readback import Decoder, HopReadback, describe_qdisc, read_hop
from streamquake.faults.tc.remove import leaf_leftovers, remove_hops, remove_leaf
from streamquake.faults.tc.state import HopState, hops_from_json
from streamquake.journal import Journal, JournalEntry
from streamquake.jsontypes import JsonDict
from streamquake.killpoints import killpoint

SCAFFOLD_JOURNAL_TYPE = "tc_scaffold"
_EEXIST = 17
SlotKey = tuple[str | None, str, bool]  # netns, ifname, via_ifb: one claim key
T = TypeVar("T")


def slot_key(hop: Hop | HopState) -> SlotKey:
    return hop.netns, hop.ifname, hop.via_ifb


@dataclass
class _Layer:
    owner: object
    leaves: Sequence[LeafQdisc]
    state: HopState  # leaf_only, as the owner's journal entry holds it
    put: bool = False  # put() began: the kernel may hold (part of) it, not the one below


@dataclass
class Slot:
    """One shaped class (and its filters) of the scaffold; ``stack`` the faults on it, newest
    last (its leaves are the ones in the kernel)."""

    hop: Hop
    state: HopState = field(init=False)  # bare, then as planned (journalled) before install
    index: int = 0  # the device the leaves hang on: the interface, or the ifb
    built: HopReadback | None = None  # the kernel's view of the scaffold part, once built
    stack: list[_Layer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = HopState.bare(self.hop)

    @property
    def parent(self) -> int:
        return TC_H_ROOT if self.hop.via_ifb else ROOT_HANDLE | (self.state.class_minor or 0)


class Scaffold:
    """Build with ``build(ctx, placements)``; ``destroy()`` removes it (idempotent)."""

    build_timeout_s = 15.0
    timeout_s = 10.0

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._entry: JournalEntry | None = None
        self._slots: dict[SlotKey, Slot] = {}
        self._by_placement: dict[Placement, list[Slot]] = {}
        self._sockets = contextlib.ExitStack()
        self._ipr: dict[str | None, IPRoute] = {}
        self._thread = _NetlinkThread()
        self._majors_used: set[int] = set()
        self.build_ms: float | None = None

    # ------------------------------------------------------------------ build and destroy

    def build(self, ctx: RunContext, placements: Sequence[Placement]) -> Scaffold:
        started = time.perf_counter()
        try:
            self._thread.call(lambda: self._build(ctx, placements), self.build_timeout_s,
                              "building the tc scaffold")
        except BaseException as exc:
            with contextlib.suppress(RevertError):  # the journal keeps it for recover
                self.destroy()
            if isinstance(exc, NetlinkError | OSError | TimeoutError):
                raise InjectorError(f"could not build the tc scaffold: {exc}") from exc
            raise
        self.build_ms = (time.perf_counter() - started) * 1000
        return self

    def _build(self, ctx: RunContext, placements: Sequence[Placement]) -> None:
        planned = {p: plan_hops(ctx, p) for p in dict.fromkeys(placements)}
        hops = _agreeing_hops(planned)
        if not hops:
            return
        addrs = resolve_addresses(ctx.target_host)
        self._entry = self._journal.add(SCAFFOLD_JOURNAL_TYPE, "tc scaffold", {"hops": []})
        for hop in hops:
            slot = Slot(hop)
            self._slots[slot_key(hop)] = slot
            ipr = self._socket(hop.netns)
            install = install_ifb if hop.via_ifb else install_htb
            install(ipr, hop, (), u32_selectors(addrs, ctx.target_port, hop.match),
                    functools.partial(self._record, slot))
            slot.index = link_index(ipr, hop.netns, slot.state.ifb or hop.ifname)
            slot.built = read_hop(ipr, slot.state, {})
        killpoint("tc.scaffold.built")
        self._by_placement = {p: [self._slots[slot_key(h)] for h in hs]
                              for p, hs in planned.items()
                              if all(slot_key(h) in self._slots for h in hs)}

    def _record(self, slot: Slot, st: HopState) -> None:
        slot.state = st
        assert self._entry is not None
        self._entry.save(self.describe())
        killpoint("tc.scaffold.journalled")

    def _socket(self, netns: str | None) -> IPRoute:
        if netns not in self._ipr:
            self._ipr[netns] = self._sockets.enter_context(iproute(netns))
        return self._ipr[netns]

    def destroy(self) -> JsonDict:
        """Remove the scaffold, with any leaf still on it; raises RevertError if it cannot."""
        started = time.perf_counter()
        with contextlib.suppress(OSError, TimeoutError):  # closing: nothing to undo
            self._thread.call(self._sockets.close, self.timeout_s, "closing netlink sockets")
        self._thread.stop()
        self._ipr.clear()
        states = [s.state for s in self._slots.values()]
        removed = remove_hops(states, self.timeout_s) if states else []
        self._slots.clear()
        self._by_placement.clear()
        if self._entry is not None:
            self._entry.done()
            self._entry = None
        return {"removed": list(removed), "destroy_ms": (time.perf_counter() - started) * 1000}

    @classmethod
    def recover(cls, state: Mapping[str, object]) -> str:
        removed = remove_hops(hops_from_json(state.get("hops")), cls.timeout_s)
        return ("removed " + "; ".join(removed)) if removed else "nothing of it was left"

    def describe(self) -> JsonDict:
        return {"hops": [s.state.to_json() for s in self._slots.values()],
                "build_ms": self.build_ms}

    # ------------------------------------------------------------------ faults on the slots

    def slots(self, placement: Placement) -> list[Slot] | None:
        """The slots for every hop of ``placement``; None where it has none (no slot there)."""
        return self._by_placement.get(placement)

    def plan(self, owner: object, slot: Slot, leaves: Sequence[LeafQdisc]) -> HopState:
        """Take leaf handles on ``slot`` for ``owner``: the state to journal before ``put``."""
        free = [m for m in reversed(LEAF_MAJORS) if m not in self._majors_used][:len(leaves)]
        if len(free) < len(leaves):
            raise InjectorError("no free qdisc handle left on the tc scaffold; revert faults")
        self._majors_used.update(free)
        st = replace(slot.state, leaf_majors=tuple(free), prefs=(), ingress_prefs=(),
                     ingress_owned=False, leaf_only=True)
        slot.stack.append(_Layer(owner, leaves, st))
        return st

    def put(self, owner: object, slot: Slot) -> None:
        """Install ``owner``'s planned leaves, in place of those of the fault it covers."""
        layer = self._layer(owner, slot)
        assert layer is not None and slot.stack[-1] is layer, "plan() first, then put()"
        layer.put = True

        def work(ipr: IPRoute) -> None:
            if len(slot.stack) > 1:
                remove_leaf(ipr, slot.stack[-2].state, [])
            add_chain(ipr, slot.index, slot.parent, layer.leaves, list(layer.state.leaf_majors))

        self._on(slot, work, "adding the fault's leaves")

    def read(self, owner: object, slot: Slot, decoders: dict[str, Decoder]) -> HopReadback:
        """The kernel's qdiscs on the slot's device now: ``owner``'s leaves (and our htb root);
        the class and filters as read back when the scaffold was built (only the leaves change
        while it stands). One dump, where reading the whole hop again takes four."""
        layer = self._layer(owner, slot)
        assert layer is not None and slot.built is not None
        mine = set(layer.state.leaf_majors) | ({ROOT_MAJOR} if not slot.hop.via_ifb else set())
        present = self._on(slot, lambda ipr: qdiscs(ipr, slot.index), "reading back")
        return replace(slot.built, qdiscs=tuple(describe_qdisc(q, decoders) for q in present
                                                if q["handle"] >> 16 in mine))

    def take(self, owner: object, slot: Slot) -> list[str]:
        """Remove ``owner``'s leaves (idempotent), put back those of the fault it covered, and
        check that none of its own is left."""
        layer = self._layer(owner, slot)
        if layer is None:
            return []
        removed: list[str] = []

        def work(ipr: IPRoute) -> list[str]:
            if slot.stack[-1] is layer and layer.put:
                remove_leaf(ipr, layer.state, removed)
                if len(slot.stack) > 1:
                    self._restore(ipr, slot, slot.stack[-2])
            return leaf_leftovers(ipr, layer.state)

        left = self._on(slot, work, "removing the fault's leaves")
        if left:
            raise RevertError(f"the tc fault is still partly in place after revert: "
                              f"{', '.join(left)}; run `streamquake recover`")
        slot.stack.remove(layer)
        self._majors_used.difference_update(layer.state.leaf_majors)
        return removed

    @staticmethod
    def _restore(ipr: IPRoute, slot: Slot, below: _Layer) -> None:
        try:
            add_chain(ipr, slot.index, slot.parent, below.leaves, list(below.state.leaf_majors))
        except NetlinkError as exc:
            if exc.code != _EEXIST:  # a put() that failed before it removed the one below
                raise

    def _layer(self, owner: object, slot: Slot) -> _Layer | None:
        return next((x for x in slot.stack if x.owner is owner), None)

    def _on(self, slot: Slot, work: Callable[[IPRoute], T], what: str) -> T:
        """``work`` with the socket of ``slot``'s namespace, on the scaffold's own thread."""
        return self._thread.call(lambda: work(self._socket(slot.hop.netns)), self.timeout_s,
                                 f"{what} on the tc scaffold")


class _NetlinkThread:
    """The one thread that makes and uses the scaffold's sockets. pyroute2 0.9 keeps an
    IPRoute's socket per thread, made at a thread's first request in whatever namespace that
    thread is in: the same IPRoute used from another thread talks to *that* thread's namespace
    (ours, not the target's). A job that never returns leaves every later call to time out."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="streamquake tc scaffold", daemon=True).start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        done: Future[T] = Future()

        def job() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                done.set_exception(exc)

        self._jobs.put(job)
        try:
            return done.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None

    def stop(self) -> None:
        self._jobs.put(None)


def _agreeing_hops(planned: Mapping[Placement, list[Hop]]) -> list[Hop]:
    """One hop per slot key, where every placement that reaches that key wants the same match.
    A placement with a hop on a key in dispute installs its own tree, whose filters would take
    the packets of a slot on its other keys too: those get no slot either."""
    wanted: dict[SlotKey, set[Hop]] = {}
    for hops in planned.values():
        for hop in hops:
            wanted.setdefault(slot_key(hop), set()).add(hop)
    disputed = {k for k, hs in wanted.items() if len(hs) > 1}
    while True:
        spread = {slot_key(h) for hs in planned.values()
                  if any(slot_key(h) in disputed for h in hs) for h in hs}
        if spread <= disputed:
            return [next(iter(hs)) for k, hs in wanted.items() if k not in disputed]
        disputed |= spread

