"""remote: faults held by an agent on another host (``at: NAME``; see ``streamquake/agent``).

Not a family of fault types: any type may run at an agent. It declares what the run and
``recover`` need for such faults: the run-long directory of the scenario's ``agents`` (checked in
preflight, reported under ``telemetry.agents``) and the recoverer of the controller's
``agent_lease`` journal entries. The machinery is in ``streamquake/run/remote.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamquake.faults.contract import Family, Recoverer, Resource

if TYPE_CHECKING:
    from streamquake.scenario import Scenario


def _resources(scenario: Scenario) -> Sequence[Resource]:
    if not scenario.agents:
        return ()
    from streamquake.run.remote import AgentDirectory

    return (AgentDirectory(scenario.agents),)


def _lease_recoverer() -> Recoverer:
    from streamquake.run.remote import recover_lease

    return recover_lease


FAMILY = Family(
    name="remote",
    faults=(),
    resources=_resources,
    recoverers={"agent_lease": _lease_recoverer},
)
