"""tc: the network path through the kernel's traffic control (netem, tbf), via pyroute2.

Private machinery: ``netlink`` (raw tc messages), ``placement`` (which interfaces and packets),
``install``/``remove``/``readback``/``probe`` (the scoped htb tree), ``scope`` (all of it for one
fault), ``netns`` (the target's own namespace), ``profiles`` (named network paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamquake.errors import PreflightError
from streamquake.faults.contract import Family, FaultType, InjectorFactory, Recoverer, Resource
from streamquake.faults.envelope import FaultSpec
from streamquake.faults.tc.spec import NetemFault, TbfFault, network_profile_fault

if TYPE_CHECKING:
    from streamquake.scenario import Scenario


def _netem() -> InjectorFactory:
    from streamquake.faults.tc.netem import NetemInjector

    return NetemInjector  # type: ignore[return-value]


def _tbf() -> InjectorFactory:
    from streamquake.faults.tc.tbf import TbfInjector

    return TbfInjector  # type: ignore[return-value]


def _where(spec: FaultSpec, scenario: Scenario) -> str:
    assert isinstance(spec, NetemFault | TbfFault)
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


def _needs_target(spec: FaultSpec) -> str | None:
    assert isinstance(spec, NetemFault | TbfFault)
    if spec.scope == "interface" and spec.interface is not None:
        return None
    return (f"{spec.type} shapes the packets to one target: give --target HOST:PORT (e.g. "
            "--target 10.0.0.7:8000), or interface=IFACE scope=interface to shape every "
            "packet on an interface")


def _resources(scenario: Scenario) -> Sequence[Resource]:
    if scenario.network.mode != "namespace":
        return ()
    if scenario.target.embedded is None:
        raise PreflightError(
            "network mode 'namespace' runs the embedded target in its own namespace; "
            "with a 'url' target use mode 'host' and a scope"
        )
    from streamquake.faults.tc.resources import TargetNamespace

    return (TargetNamespace(),)


def _implied(scenario: Scenario) -> Sequence[FaultSpec]:
    """A network profile (``network.profile``) shapes the path for the whole run."""
    profile = network_profile_fault(scenario.network)
    return () if profile is None else (profile,)


def _namespace_recoverer() -> Recoverer:
    from streamquake.faults.tc.netns import NamespaceTopology

    return NamespaceTopology.recover


FAMILY = Family(
    name="tc",
    faults=(
        FaultType("netem", NetemFault, _netem,
                  "delay, jitter, loss, duplication, corruption, reordering, rate (needs netem)",
                  _where, _needs_target),
        FaultType("tbf", TbfFault, _tbf, "a token-bucket bandwidth limit", _where,
                  _needs_target),
    ),
    resources=_resources,
    implied=_implied,
    recoverers={"netns": _namespace_recoverer},
)
