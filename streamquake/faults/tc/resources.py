"""The tc family's run-long part: the embedded target's own network namespace."""

from __future__ import annotations

from typing import Literal

from streamquake.faults.contract import JsonDict, RunContext, Wiring
from streamquake.faults.tc.netns import NamespaceTopology


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
