"""streamquake: chaos-engineering and load-test harness for streaming LLM endpoints.

The public surface is what ``__all__`` lists (tests/test_public_api.py guards it): the errors
and exit codes, the scenario (``Scenario``, ``load_scenario``, ``parse_scenario``), the runner
and its result (``Runner``, ``RunResult``), and the fault-family contract (``Family``,
``FaultType``, ``FaultSpec``, ``Injector``, ``InjectorFactory``, ``Resource``, ``RunContext``,
``Wiring``; the whole contract is ``streamquake.faults.contract.__all__``). Everything
else, private modules included, may change. The heavier names are imported on first use, so
``import streamquake`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from streamquake.errors import (
    EXIT_ABORTED,
    EXIT_ENVIRONMENT,
    EXIT_OK,
    EXIT_REVERT_FAILED,
    EXIT_SCENARIO,
    EXIT_SLO_BROKEN,
    InjectorError,
    PreflightError,
    RevertError,
    ScenarioError,
    StreamquakeError,
    TargetError,
)
from streamquake.version import __version__

if TYPE_CHECKING:
    from streamquake.faults.contract import (
        Family,
        FaultSpec,
        FaultType,
        Injector,
        InjectorFactory,
        Resource,
        RunContext,
        Wiring,
    )
    from streamquake.result import RunResult
    from streamquake.run.runner import Runner
    from streamquake.scenario import Scenario, load_scenario, parse_scenario


_LAZY = {
    "Family": "streamquake.faults.contract",
    "FaultSpec": "streamquake.faults.contract",
    "FaultType": "streamquake.faults.contract",
    "Injector": "streamquake.faults.contract",
    "InjectorFactory": "streamquake.faults.contract",
    "Resource": "streamquake.faults.contract",
    "RunContext": "streamquake.faults.contract",
    "Wiring": "streamquake.faults.contract",
    "RunResult": "streamquake.result",
    "Runner": "streamquake.run.runner",
    "Scenario": "streamquake.scenario",
    "load_scenario": "streamquake.scenario",
    "parse_scenario": "streamquake.scenario",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'streamquake' has no attribute {name!r}")


__all__ = [
    "EXIT_ABORTED",
    "EXIT_ENVIRONMENT",
    "EXIT_OK",
    "EXIT_REVERT_FAILED",
    "EXIT_SCENARIO",
    "EXIT_SLO_BROKEN",
    "Family",
    "FaultSpec",
    "FaultType",
    "Injector",
    "InjectorError",
    "InjectorFactory",
    "PreflightError",
    "Resource",
    "RevertError",
    "RunContext",
    "RunResult",
    "Runner",
    "Scenario",
    "ScenarioError",
    "StreamquakeError",
    "TargetError",
    "Wiring",
    "__version__",
    "load_scenario",
    "parse_scenario",
]
