"""The tc family's scenario models: netem and tbf faults (the ``network:`` section they default
to is the scenario's, read through ``NetworkView``). Light on purpose (pydantic and the standard
library only): ``streamquake validate`` imports it."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from streamquake.faults.contract import NetworkView
from streamquake.faults.envelope import FaultSpec
from streamquake.faults.tc.profiles import get_profile
from streamquake.units import DurationMs, Fraction, Rate, Size


class TcPlacement(BaseModel):
    """Per-fault overrides of the scenario's ``network:`` section (None: take it from there)."""

    interface: str | None = Field(None, description="the interface to shape (default: "
                                  "network.interface, else the one routing to the target)")
    scope: Literal["target", "interface"] | None = Field(
        None, description="target: only packets to and from the target's address and port; "
        "interface: every packet on the interface (default: network.scope)")
    direction: Literal["egress", "both"] | None = Field(
        None, description="egress: packets toward the target; both: its answers too "
        "(default: network.direction)")


Distribution = Literal["normal", "pareto", "paretonormal"]
_UNIFORM = (
    "netem has no 'uniform' distribution table: its default jitter is already uniform over "
    "delay +- jitter, so leave `distribution` out for uniform; the tables are normal, pareto "
    "and paretonormal"
)


class NetemFault(FaultSpec, TcPlacement):
    """A netem fault as a scenario writes it (``delay: 100ms``, ``loss: 1.5%``, ``rate: 8mbit``)."""

    type: Literal["netem"] = "netem"
    profile: str | None = Field(None, description="a named network path whose settings are "
                                "the defaults here (docs: Faults, Profiles)")
    delay_ms: DurationMs = Field(0.0, alias="delay", ge=0, le=3_600_000,
                                 description="added to every packet")
    jitter_ms: DurationMs = Field(0.0, alias="jitter", ge=0, le=3_600_000,
                                  description="the delay varies by up to this much")
    correlation: Fraction = Field(0.0, description="how much each delay follows the last one")
    distribution: Distribution | None = Field(None, description="the jitter's shape "
                                              "(default: uniform)")
    loss: Fraction = Field(0.0, description="packets dropped")
    loss_correlation: Fraction = Field(0.0, description="how much each loss follows the last")
    duplicate: Fraction = Field(0.0, description="packets sent twice")
    duplicate_correlation: Fraction = Field(0.0, description="how much each duplicate follows "
                                            "the last")
    corrupt: Fraction = Field(0.0, description="packets with a flipped bit")
    corrupt_correlation: Fraction = Field(0.0, description="how much each corruption follows "
                                          "the last")
    reorder: Fraction = Field(0.0, description="packets sent at once while the rest wait "
                              "`delay`")
    reorder_correlation: Fraction = Field(0.0, description="how much each reordering follows "
                                          "the last")
    gap: int = Field(0, ge=0, description="reorder every Nth packet instead")
    rate_bytes_per_s: Rate | None = Field(None, alias="rate", gt=0,
                                          description="a bandwidth cap")
    limit: int = Field(1000, ge=1, description="packets netem may hold at once")

    @field_validator("distribution", mode="before")
    @classmethod
    def _no_uniform(cls, v: object) -> object:
        if isinstance(v, str) and v.strip().lower() == "uniform":
            raise ValueError(_UNIFORM)
        return v

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("profile"):
            return {**get_profile(str(data["profile"])).netem_fields(), **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> NetemFault:
        needs = [
            (self.distribution is not None, self.jitter_ms > 0,
             "`distribution` shapes the jitter, so it needs `jitter` > 0"),
            (self.correlation > 0, self.jitter_ms > 0,
             "`correlation` ties successive delays together, so it needs `jitter` > 0"),
            (self.loss_correlation > 0, self.loss > 0, "`loss_correlation` needs `loss` > 0"),
            (self.duplicate_correlation > 0, self.duplicate > 0,
             "`duplicate_correlation` needs `duplicate` > 0"),
            (self.corrupt_correlation > 0, self.corrupt > 0,
             "`corrupt_correlation` needs `corrupt` > 0"),
            (self.reorder > 0, self.delay_ms > 0,
             "`reorder` sends some packets at once while the rest wait `delay`, so it needs "
             "`delay` > 0"),
            (self.reorder_correlation > 0 or self.gap > 0, self.reorder > 0,
             "`reorder_correlation` and `gap` need `reorder` > 0"),
        ]
        for given, required, sentence in needs:
            if given and not required:
                raise ValueError(sentence)
        if not (self.delay_ms or self.loss or self.duplicate or self.corrupt or self.reorder
                or self.rate_bytes_per_s):
            raise ValueError("this netem fault changes nothing: set at least one of delay, "
                             "loss, duplicate, corrupt, reorder or rate")
        return self

    def over(self, base: NetemFault) -> NetemFault:
        """This fault on top of the path ``base`` (a network profile)."""

        def either(a: float, b: float) -> float:
            return 1 - (1 - a) * (1 - b)

        return self.model_copy(update={
            "delay_ms": base.delay_ms + self.delay_ms,
            "jitter_ms": math.hypot(base.jitter_ms, self.jitter_ms),
            "distribution": self.distribution or base.distribution,
            "loss": either(base.loss, self.loss),
            "duplicate": either(base.duplicate, self.duplicate),
            "corrupt": either(base.corrupt, self.corrupt),
            "rate_bytes_per_s": self.rate_bytes_per_s or base.rate_bytes_per_s,
        })


def network_profile_fault(network: NetworkView | None) -> NetemFault | None:
    """The whole-run netem fault for ``network.profile`` (None when no profile is set)."""
    if network is None or network.profile is None:
        return None
    return NetemFault.model_validate(
        {"profile": network.profile, "name": f"network profile {network.profile}"})


_MAX_RATE = 0xFFFFFFFF  # bytes/s in tc_tbf_qopt; above that needs TCA_TBF_RATE64
_FULL_PACKET = 1514


class TbfFault(FaultSpec, TcPlacement):
    type: Literal["tbf"] = "tbf"
    rate_bytes_per_s: Rate = Field(alias="rate", gt=0, description="the bandwidth limit")
    burst_bytes: Size | None = Field(None, alias="burst", description="how much may go out at "
                                     "line speed after an idle spell (default: 10 ms of rate)")
    latency_ms: DurationMs = Field(50.0, alias="latency", gt=0, description="how long a packet "
                                   "may wait for tokens (the queue holds rate * latency + burst)")

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
