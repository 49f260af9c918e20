"""proxy: an SSE-aware reverse proxy that drops, delays, stalls, truncates or corrupts chunks.

Private machinery: ``server`` (the proxy process, aiohttp), ``decisions`` (what a fault does to
each event), ``framing`` (SSE events on the wire), ``injector`` (the control API client).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamquake.faults.contract import Family, FaultSpec, FaultType, InjectorFactory, Resource
from streamquake.faults.proxy.spec import SSEProxyFault

if TYPE_CHECKING:
    from streamquake.scenario import Scenario


def _injector() -> InjectorFactory:
    from streamquake.faults.proxy.injector import SSEProxyInjector

    return SSEProxyInjector  # type: ignore[return-value]


def _resources(scenario: Scenario) -> Sequence[Resource]:
    if not any(f.type == "sse_proxy" for f in scenario.faults):
        return ()
    from streamquake.faults.proxy.resources import FaultProxy

    return (FaultProxy(insecure=not scenario.target.verify_tls),)


def _where(spec: FaultSpec, scenario: Scenario) -> str:
    return ("inside the SSE proxy this run starts in front of the target (a process of its "
            "own), switched on and off through its control API; nothing outside it changes")


FAMILY = Family(
    name="proxy",
    faults=(FaultType("sse_proxy", SSEProxyFault, _injector,
                      "drop, delay, stall, truncate, abort, reset or corrupt SSE events",
                      _where),),
    resources=_resources,
)
