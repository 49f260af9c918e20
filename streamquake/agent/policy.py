"""What an agent may touch: fault types, network interfaces (tc faults) and GPUs (gpu_clocks).

Each refusal is a sentence that says what is allowed, so the person at the controller can fix
the scenario without reading the agent's configuration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamquake.agent.api import Allowed
from streamquake.faults.envelope import FaultSpec
from streamquake.faults.gpu.spec import GpuClocksFault
from streamquake.faults.tc.spec import NetworkConfig, TcPlacement


def _split(values: Iterable[str] | None) -> frozenset[str] | None:
    """``["a,b", "c"]`` -> {a, b, c}; None or nothing given: no restriction."""
    if not values:
        return None
    out = {v.strip() for raw in values for v in raw.split(",") if v.strip()}
    return frozenset(out) or None


@dataclass(frozen=True)
class Allowlist:
    types: frozenset[str]
    interfaces: frozenset[str] | None = None
    gpus: frozenset[str] | None = None

    @classmethod
    def build(cls, known_types: Iterable[str], types: Iterable[str] | None = None,
              interfaces: Iterable[str] | None = None,
              gpus: Iterable[str] | None = None) -> Allowlist:
        """Raises ValueError for a type no family offers here (a typo would allow nothing)."""
        known = frozenset(known_types)
        wanted = _split(types)
        if wanted is not None and wanted - known:
            unknown = ", ".join(sorted(wanted - known))
            raise ValueError(f"--allow-types names fault types this agent does not have: "
                             f"{unknown}; known: {', '.join(sorted(known))}")
        return cls(types=wanted if wanted is not None else known,
                   interfaces=_split(interfaces), gpus=_split(gpus))

    def view(self) -> Allowed:
        return Allowed(types=sorted(self.types),
                       interfaces=None if self.interfaces is None else sorted(self.interfaces),
                       gpus=None if self.gpus is None else sorted(self.gpus))

    def type_refusal(self, type_name: str) -> str | None:
        if type_name in self.types:
            return None
        return (f"this agent does not allow {type_name} faults; it allows: "
                f"{', '.join(sorted(self.types)) or 'none'}")

    def refusal(self, spec: FaultSpec, network: NetworkConfig | None) -> str | None:
        """Why this agent must not apply ``spec`` (None: it may)."""
        said = self.type_refusal(spec.type)
        if said is None and isinstance(spec, TcPlacement):
            said = self._interface_refusal(spec, network)
        if said is None and isinstance(spec, GpuClocksFault):
            said = self._gpu_refusal(spec)
        return said

    def _interface_refusal(self, spec: TcPlacement, network: NetworkConfig | None) -> str | None:
        if network is not None and network.mode == "namespace":
            return ("network mode 'namespace' belongs to a local run's embedded target; an "
                    "agent shapes its own host's interfaces: use mode 'host'")
        if self.interfaces is None:
            return None
        allowed = ", ".join(sorted(self.interfaces))
        ifname = spec.interface or (network.interface if network is not None else None)
        if ifname is None:
            return (f"this agent may shape only {allowed}: name the interface (`interface:` on "
                    "the fault, or `network.interface`)")
        if ifname not in self.interfaces:
            return f"this agent may not shape {ifname}; it may shape only {allowed}"
        return None

    def _gpu_refusal(self, spec: GpuClocksFault) -> str | None:
        if self.gpus is None:
            return None
        allowed = ", ".join(sorted(self.gpus))
        if spec.gpus == "all":
            return (f"`gpus: all` would touch every GPU, and this agent may touch only "
                    f"{allowed}: list them")
        outside = [str(g) for g in spec.gpus if str(g) not in self.gpus]
        if outside:
            return (f"this agent may not touch GPU {', '.join(outside)}; it may touch only "
                    f"{allowed} (give GPUs as the agent lists them, index or UUID)")
        return None
