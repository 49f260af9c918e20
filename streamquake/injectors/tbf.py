"""tbf: a token-bucket bandwidth limit on the target's path (``rate: 1mbit, burst: 32kb``).

Works on kernels without netem. On a run with ``network.profile`` set, the profile's netem
hangs under the tbf, so the path keeps its latency while its bandwidth is limited.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pyroute2 import IPRoute

from streamquake.errors import InjectorError
from streamquake.injectors.base import RunContext, register
from streamquake.injectors.netem import (
    add_netem,
    decode_netem,
    kernel_options,
    load_table,
    network_profile_fault,
)
from streamquake.injectors.spec import FaultSpec
from streamquake.injectors.tc_install import LeafQdisc
from streamquake.injectors.tc_placement import TcPlacement
from streamquake.injectors.tc_scope import ScopedTc
from streamquake.journal import JournalEntry
from streamquake.units import parse_duration_ms, parse_rate_bytes_per_s, parse_size_bytes

_MAX_RATE = 0xFFFFFFFF  # bytes/s in tc_tbf_qopt; above that needs TCA_TBF_RATE64
_FULL_PACKET = 1514


class TbfFault(FaultSpec, TcPlacement):
    type: Literal["tbf"] = "tbf"
    rate_bytes_per_s: float = Field(alias="rate", gt=0)
    # Bucket size: how much may go out at line speed after an idle spell. Default: 10 ms of rate.
    burst_bytes: int | None = Field(None, alias="burst")
    # How long a packet may wait for tokens; sets the queue limit (rate * latency + burst).
    latency_ms: float = Field(50.0, alias="latency", gt=0)

    _rate = field_validator("rate_bytes_per_s", mode="before")(lambda v: parse_rate_bytes_per_s(v))
    _burst = field_validator("burst_bytes", mode="before")(
        lambda v: None if v is None else parse_size_bytes(v))
    _latency = field_validator("latency_ms", mode="before")(lambda v: parse_duration_ms(v))

    @model_validator(mode="after")
    def _sane(self) -> TbfFault:
        if self.rate_bytes_per_s > _MAX_RATE:
            raise ValueError("tbf rate above 34 gbit is not supported; use a lower `rate`")
        if self.burst_bytes is not None and self.burst_bytes < _FULL_PACKET:
            raise ValueError(f"`burst` {self.burst_bytes} bytes is smaller than one full-size "
                             f"packet ({_FULL_PACKET} bytes), so such packets could never pass; "
                             "use at least 2kb")
        return self

    @property
    def burst(self) -> int:
        return self.burst_bytes or max(round(self.rate_bytes_per_s / 100), 4 * 1024)


@register("tbf")
class TbfInjector:
    type_name: ClassVar[str]

    def __init__(self, spec: TbfFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.profile = network_profile_fault(ctx.extra.get("network"))
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

    def apply(self, entry: JournalEntry) -> dict[str, Any]:
        result = self._tc.apply(entry)
        for hop in result["kernel"]:
            got = [q.get("options", {}) for q in hop.get("qdiscs", []) if q["kind"] == "tbf"]
            if not got or got[0].get("rate_bytes_per_s") != round(self.spec.rate_bytes_per_s):
                self.revert()
                raise InjectorError(
                    f"the kernel does not hold the tbf rate that was sent on {hop['ifname']} "
                    f"(read back: {got or 'no tbf qdisc found'}); the fault was reverted"
                )
        return {"configured": self.describe(), **result}

    def revert(self) -> dict[str, Any]:
        return self._tc.revert()

    def describe(self) -> dict[str, Any]:
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
    def recover(cls, state: dict[str, Any]) -> str:
        return "tbf fault: " + ScopedTc.recover(state)
