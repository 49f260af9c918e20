"""tbf: a token-bucket bandwidth limit on the target's path (``rate: 1mbit, burst: 32kb``).

Works on kernels without netem. On a run with ``network.profile`` set, the profile's netem
hangs under the tbf, so the path keeps its latency while its bandwidth is limited.
"""

from __future__ import annotations

from pyroute2 import IPRoute

from streamquake.errors import InjectorError
from streamquake.faults.contract import RunContext
from streamquake.faults.tc.install import LeafQdisc
from streamquake.faults.tc.netem import (
    add_netem,
    decode_netem,
    kernel_options,
    load_table,
)
from streamquake.faults.tc.scope import ScopedTc
from streamquake.faults.tc.spec import TbfFault, network_profile_fault
from streamquake.journal import JournalEntry
from streamquake.jsontypes import JsonDict


class TbfInjector:
    type_name = "tbf"

    def __init__(self, spec: TbfFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.profile = network_profile_fault(ctx.network)
        leaves = [LeafQdisc("tbf", self._add_tbf)]
        if self.profile is not None:
            leaves.append(LeafQdisc("netem", self._add_profile))
        self._tc = ScopedTc(ctx, spec, leaves, {"netem": decode_netem})

    def _add_tbf(self, ipr: IPRoute, index: int, parent: int, handle: int) -> None:
        s = self.spec
        ipr.tc("add", "tbf", index=index, handle=handle, parent=parent,
               rate=round(s.rate_bytes_per_s), burst=s.burst, latency=round(s.latency_ms * 1000))

    def _add_profile(self, ipr: IPRoute, index: int, parent: int, handle: int) -> None:
        assert self.profile is not None
        table = load_table(self.profile.distribution) if self.profile.distribution else None
        add_netem(ipr, index, parent, handle, kernel_options(self.profile, table))

    def preflight(self) -> list[str]:
        return self._tc.preflight()

    def apply(self, entry: JournalEntry) -> JsonDict:
        applied = self._tc.apply(entry)
        for hop in applied.kernel:
            got = [q.options or {} for q in hop.qdiscs if q.kind == "tbf"]
            if not got or got[0].get("rate_bytes_per_s") != round(self.spec.rate_bytes_per_s):
                self.revert()
                raise InjectorError(
                    f"the kernel does not hold the tbf rate that was sent on {hop.ifname} "
                    f"(read back: {got or 'no tbf qdisc found'}); the fault was reverted"
                )
        return applied.to_json()   # the configured view is describe()'s, in the record once

    def revert(self) -> JsonDict:
        return self._tc.revert()

    def describe(self) -> JsonDict:
        s = self.spec
        placement = self._tc.placement
        return {
            "type": "tbf", "name": s.label, "rate_bytes_per_s": s.rate_bytes_per_s,
            "rate_mbit": s.rate_bytes_per_s * 8 / 1e6, "burst_bytes": s.burst,
            "latency_ms": s.latency_ms, "scope": placement.scope,
            "direction": placement.direction, "interface": placement.interface,
            "over_network_profile": self.profile.profile if self.profile else None,
        }

    @classmethod
    def recover(cls, state: dict[str, object]) -> str:
        return "tbf fault: " + ScopedTc.recover(state)
