"""The tc family's run-long parts: the embedded target's own network namespace, and the
scoping scaffold its faults hang their leaves on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from streamquake.errors import InjectorError
from streamquake.faults.contract import JsonDict, RunContext, Wiring
from streamquake.faults.tc.netns import NamespaceTopology
from streamquake.faults.tc.placement import resolve_placement
from streamquake.faults.tc.scaffold import Scaffold
from streamquake.faults.tc.spec import TcPlacement
from streamquake.journal import Journal


class TargetNamespace:
    """``network: {mode: namespace}``: the target runs in ``sq-<id>`` behind a veth pair, so a
    tc fault on its path shapes nothing else. Journalled before it is created (type ``netns``)."""

    key = "namespace"
    title = "the target's network namespace"
    stage: Literal["before_target", "after_target"] = "before_target"

    def __init__(self) -> None:
        self.topology: NamespaceTopology | None = None

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        self.topology = NamespaceTopology(journal=ctx.journal).create()
        wiring.target_netns = self.topology.name
        wiring.target_bind_host = self.topology.target_addr
        wiring.target_cmd_prefix = self.topology.cmd_prefix()

    def stop(self) -> None:
        if self.topology is not None:
            self.topology.destroy()

    def report(self) -> JsonDict | None:
        return None if self.topology is None else self.topology.describe()


class TcScaffold:
    """The run's tc faults' htb tree, u32 filters and ifb, built once after the target starts
    so that each fault's apply and revert change only its leaf qdiscs (``scaffold``).

    Where it cannot be built (a root qdisc that is not ours, a kernel without htb or u32) the
    run goes on without it: each fault installs its own tree, and its preflight says what is in
    the way. Journalled as its own entry (type ``tc_scaffold``) before it changes anything."""

    key = "tc_scaffold"
    title = "the tc faults' scoping scaffold (htb tree, u32 filters, ifb)"
    stage: Literal["before_target", "after_target"] = "after_target"

    def __init__(self, placements: Sequence[TcPlacement]) -> None:
        self.placements = list(placements)
        self.scaffold: Scaffold | None = None
        self.problem: str | None = None

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        ctx = replace(ctx, target_netns=wiring.target_netns)
        try:
            self.scaffold = Scaffold(ctx.journal or Journal()).build(
                ctx, [resolve_placement(p, ctx) for p in self.placements])
        except InjectorError as exc:
            self.problem = f"not built, each fault installs its own tree: {exc}"

    def stop(self) -> None:
        if self.scaffold is not None:
            self.scaffold.destroy()

    def report(self) -> JsonDict | None:
        if self.problem is not None:
            return {"problem": self.problem}
        return None if self.scaffold is None else self.scaffold.describe()
