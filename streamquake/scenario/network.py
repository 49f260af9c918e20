"""The scenario's ``network:`` section: where the target lives and where tc faults land by
default. The scenario owns it; the tc family reads it through the contract's ``NetworkView``."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from streamquake.faults.catalog import check_network_profile
from streamquake.units import ScenarioModel


class NetworkConfig(ScenarioModel):
    """The scenario's ``network:`` section: where the target lives and where tc faults land."""

    mode: Literal["host", "namespace"] = "host"
    # host mode: the interface to shape; default: the one the kernel routes the target through.
    interface: str | None = None
    # target: only packets to/from the target's address and port; interface: everything on it.
    scope: Literal["target", "interface"] = "target"
    # egress: packets toward the target; both: also the target's answers.
    direction: Literal["egress", "both"] = "egress"
    # a path profile (faults/tc/profiles.py) applied on the target path for the whole run.
    profile: str | None = None

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str | None) -> str | None:
        if v is not None:
            check_network_profile(v)
        return v

    @model_validator(mode="after")
    def _interface_in_host_mode(self) -> NetworkConfig:
        if self.mode == "namespace" and self.interface is not None:
            raise ValueError(
                "network.interface applies to mode: host; in mode: namespace the faults land on "
                "the target's own veth pair, so remove `interface`"
            )
        return self
