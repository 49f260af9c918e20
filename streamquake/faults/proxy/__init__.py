"""proxy: an SSE-aware reverse proxy that drops, delays, stalls, truncates or corrupts chunks.

Private machinery: ``server`` (the proxy process, aiohttp), ``decisions`` (what a fault does to
each event), ``framing`` (SSE events on the wire), ``injector`` (the control API client).
"""

from __future__ import annotations

from collections.abc import Sequence

from streamquake.faults.contract import (
    AgentAbility,
    AllowOption,
    Allows,
    Family,
    FaultSpec,
    FaultType,
    HoldRequest,
    InjectorFactory,
    Resource,
    RunningStanding,
    ScenarioView,
    Standing,
)
from streamquake.faults.proxy.spec import SSEProxyFault


def _injector() -> InjectorFactory[SSEProxyFault]:
    from streamquake.faults.proxy.injector import SSEProxyInjector

    return SSEProxyInjector


def _resources(scenario: ScenarioView) -> Sequence[Resource]:
    if not any(f.type == "sse_proxy" for f in scenario.faults):
        return ()
    from streamquake.faults.proxy.resources import FaultProxy

    return (FaultProxy(insecure=not scenario.target.verify_tls),)


def _where(spec: SSEProxyFault, scenario: ScenarioView) -> str:
    return ("inside the SSE proxy this run starts in front of the target (a process of its "
            "own), switched on and off through its control API; nothing outside it changes")


def _address(text: str) -> str:
    from streamquake.faults.proxy.standing import control_url_for, proxy_address

    return proxy_address(control_url_for(text))


def _refusal(spec: FaultSpec, allows: Allows, request: HoldRequest) -> str | None:
    proxies = allows.get("proxies")
    if not isinstance(spec, SSEProxyFault) or request.standing is None or proxies is None:
        return None
    from streamquake.faults.proxy.standing import proxy_address

    address = proxy_address(request.standing)
    if address in proxies:
        return None
    return (f"this agent may not touch the SSE proxy at {address}; it may touch only "
            f"{', '.join(sorted(proxies))} (its --allow-proxies)")


def _control_url(text: str) -> str:
    from streamquake.faults.proxy.standing import control_url_for

    return control_url_for(text)


def _shown(control_url: str) -> str:
    from streamquake.faults.proxy.standing import proxy_address

    return proxy_address(control_url)


def _attach(control_url: str) -> Resource:
    from streamquake.faults.proxy.resources import FaultProxy

    return FaultProxy.attached(control_url)


def _running() -> Sequence[RunningStanding]:
    from streamquake.faults.proxy.standing import running_proxies

    return [RunningStanding(p.address, p.upstream, p.control_url) for p in running_proxies()]


FAMILY = Family(
    name="proxy",
    faults=(FaultType[SSEProxyFault]("sse_proxy", SSEProxyFault, _injector,
                                     "drop, delay, stall, truncate, abort, reset or corrupt SSE "
                                     "events", _where),),
    resources=_resources,
    agent=AgentAbility(
        options=(AllowOption("proxies", "Standing SSE proxies (HOST:PORT) sse_proxy faults may "
                             "go into (default: any).", "SSE proxies", _address),),
        refusal=_refusal),
    standing=Standing("standing SSE proxy", "standing SSE proxies", frozenset({"sse_proxy"}),
                      _control_url, _shown, _attach, "streamquake proxy --upstream URL",
                      _running),
)
