"""What an agent may touch: fault types, network interfaces (tc faults), GPUs (gpu_clocks) and
standing SSE proxies (sse_proxy).

Each refusal is a sentence that says what is allowed, so the person at the controller can fix
the scenario without reading the agent's configuration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamquake.agentwire.api import Allowed
from streamquake.faults.envelope import FaultSpec
from streamquake.faults.gpu.spec import GpuClocksFault
from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.faults.proxy.standing import control_url_for, proxy_address
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
    proxies: frozenset[str] | None = None     # HOST:PORT of standing SSE proxies

    @classmethod
    def build(cls, known_types: Iterable[str], types: Iterable[str] | None = None,
              interfaces: Iterable[str] | None = None,
              gpus: Iterable[str] | None = None,
              proxies: Iterable[str] | None = None) -> Allowlist:
        """Raises ValueError for a type no family offers here (a typo would allow nothing), or
        a proxy that is no HOST:PORT."""
        known = frozenset(known_types)
        wanted = _split(types)
        if wanted is not None and wanted - known:
            unknown = ", ".join(sorted(wanted - known))
            raise ValueError(f"--allow-types names fault types this agent does not have: "
                             f"{unknown}; known: {', '.join(sorted(known))}")
        listed = _split(proxies)
        try:
            addresses = (None if listed is None else
                         frozenset(proxy_address(control_url_for(p)) for p in listed))
        except ValueError as exc:
            raise ValueError(f"--allow-proxies: {exc}") from None
        return cls(types=wanted if wanted is not None else known,
                   interfaces=_split(interfaces), gpus=_split(gpus), proxies=addresses)

    def view(self) -> Allowed:
        return Allowed(types=sorted(self.types),
                       interfaces=None if self.interfaces is None else sorted(self.interfaces),
                       gpus=None if self.gpus is None else sorted(self.gpus),
                       proxies=None if self.proxies is None else sorted(self.proxies))

    def type_refusal(self, type_name: str) -> str | None:
        if type_name in self.types:
            return None
        return (f"this agent does not allow {type_name} faults; it allows: "
                f"{', '.join(sorted(self.types)) or 'none'}")

    def refusal(self, spec: FaultSpec, network: NetworkConfig | None,
                proxy: str | None = None) -> str | None:
        """Why this agent must not apply ``spec`` (None: it may); ``proxy``: the control URL
        of the standing SSE proxy it would go into."""
        said = self.type_refusal(spec.type)
        if said is None and isinstance(spec, TcPlacement):
            said = self._interface_refusal(spec, network)
        if said is None and isinstance(spec, GpuClocksFault):
            said = self._gpu_refusal(spec)
        if said is None and isinstance(spec, SSEProxyFault) and proxy is not None:
            said = self._proxy_refusal(proxy)
        return said

    def _proxy_refusal(self, control_url: str) -> str | None:
        if self.proxies is None:
            return None
        address = proxy_address(control_url)
        if address in self.proxies:
            return None
        return (f"this agent may not touch the SSE proxy at {address}; it may touch only "
                f"{', '.join(sorted(self.proxies))} (its --allow-proxies)")

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
