"""tc: the network path through the kernel's traffic control (netem, tbf), via pyroute2.

Private machinery: ``netlink`` (raw tc messages), ``placement`` (which interfaces and packets),
``install``/``remove``/``readback``/``probe`` (the scoped htb tree), ``scaffold`` (that tree
built once for a run), ``scope`` (all of it for one fault), ``netns`` (the target's own
namespace), ``profiles`` (named network paths).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from streamquake.faults.contract import (
    AgentAbility,
    AllowOption,
    Allows,
    Family,
    FaultSpec,
    FaultType,
    HoldRequest,
    InjectorFactory,
    PreflightError,
    Recoverer,
    Resource,
    ScenarioView,
)
from streamquake.faults.tc.spec import NetemFault, TbfFault, TcPlacement, network_profile_fault


def _netem() -> InjectorFactory[NetemFault]:
    from streamquake.faults.tc.netem import NetemInjector

    return NetemInjector


def _tbf() -> InjectorFactory[TbfFault]:
    from streamquake.faults.tc.tbf import TbfInjector

    return TbfInjector


def _where(spec: NetemFault | TbfFault, scenario: ScenarioView) -> str:
    net = scenario.network
    scope, direction = spec.scope or net.scope, spec.direction or net.direction
    iface = spec.interface or net.interface
    if net.mode == "namespace":
        dev = "the target namespace's veth pair (sqh*/sqt*)"
    else:
        dev = (f"interface {iface}" if iface
               else "the interface the kernel routes the target through")
    what = ("only packets to and from the target's address and port (htb 5351: + u32 filters)"
            if scope == "target" else "every packet on it")
    back = " and the answers" if direction == "both" else ""
    return (f"qdiscs on {dev}: {what}, toward the target{back}; removed by their reserved "
            "handles")


def _needs_target(spec: NetemFault | TbfFault) -> str | None:
    if spec.scope == "interface" and spec.interface is not None:
        return None
    return (f"{spec.type} shapes the packets to one target: give --target HOST:PORT (e.g. "
            "--target 10.0.0.7:8000), or interface=IFACE scope=interface to shape every "
            "packet on an interface")


def _resources(scenario: ScenarioView) -> Sequence[Resource]:
    return (*_namespace(scenario), *_scaffold(scenario))


def _namespace(scenario: ScenarioView) -> Sequence[Resource]:
    if scenario.network.mode != "namespace":
        return ()
    if scenario.target.embedded is None:
        raise PreflightError(
            "network mode 'namespace' runs the embedded target in its own namespace; "
            "with a 'url' target use mode 'host' and a scope"
        )
    from streamquake.faults.tc.resources import TargetNamespace

    return (TargetNamespace(),)


def _scaffold(scenario: ScenarioView) -> Sequence[Resource]:
    """The htb tree and filters of the run's local tc faults, built once (faults/tc/scaffold)."""
    local = [f for f in (*scenario.faults, *_implied(scenario))
             if isinstance(f, TcPlacement) and f.at is None]
    if not local:
        return ()
    from streamquake.faults.tc.resources import TcScaffold

    return (TcScaffold(local),)


def _implied(scenario: ScenarioView) -> Sequence[FaultSpec]:
    """A network profile (``network.profile``) shapes the path for the whole run."""
    profile = network_profile_fault(scenario.network)
    return () if profile is None else (profile,)


def _namespace_recoverer() -> Recoverer:
    from streamquake.faults.tc.netns import NamespaceTopology

    return NamespaceTopology.recover


def _scaffold_recoverer() -> Recoverer:
    from streamquake.faults.tc.scaffold import Scaffold

    return Scaffold.recover


def _refusal(spec: FaultSpec, allows: Allows, request: HoldRequest) -> str | None:
    if not isinstance(spec, TcPlacement):
        return None
    network = request.network
    if network is not None and network.mode == "namespace":
        return ("network mode 'namespace' belongs to a local run's embedded target; an "
                "agent shapes its own host's interfaces: use mode 'host'")
    interfaces = allows.get("interfaces")
    if interfaces is None:
        return None
    allowed = ", ".join(sorted(interfaces))
    ifname = spec.interface or (network.interface if network is not None else None)
    if ifname is None:
        return (f"this agent may shape only {allowed}: name the interface (`interface:` on "
                "the fault, or `network.interface`)")
    if ifname not in interfaces:
        return f"this agent may not shape {ifname}; it may shape only {allowed}"
    return None


def _capabilities() -> Mapping[str, bool]:
    from streamquake.faults.tc.netns import has_cap_net_admin

    return {"cap_net_admin": has_cap_net_admin()}


def _network_profiles() -> Sequence[str]:
    from streamquake.faults.tc.profiles import PROFILES

    return sorted(PROFILES)


FAMILY = Family(
    name="tc",
    faults=(
        FaultType[NetemFault](
            "netem", NetemFault, _netem,
            "delay, jitter, loss, duplication, corruption, reordering, rate (needs netem)",
            _where, _needs_target),
        FaultType[TbfFault]("tbf", TbfFault, _tbf, "a token-bucket bandwidth limit", _where,
                            _needs_target),
    ),
    resources=_resources,
    implied=_implied,
    recoverers={"netns": _namespace_recoverer, "tc_scaffold": _scaffold_recoverer},
    agent=AgentAbility(
        options=(AllowOption("interfaces", "Network interfaces tc faults may shape (default: "
                             "any).", "interfaces"),),
        refusal=_refusal, capabilities=_capabilities),
    network_profiles=_network_profiles,
)
