"""streamquake: chaos-engineering and load-test harness for streaming LLM endpoints."""

from streamquake.errors import (
    EXIT_ENVIRONMENT,
    EXIT_OK,
    EXIT_REVERT_FAILED,
    EXIT_SCENARIO,
    EXIT_SLO_BROKEN,
    InjectorError,
    PreflightError,
    ScenarioError,
    StreamquakeError,
    TargetError,
)

__version__ = "0.1.0"

__all__ = [
    "EXIT_ENVIRONMENT",
    "EXIT_OK",
    "EXIT_REVERT_FAILED",
    "EXIT_SCENARIO",
    "EXIT_SLO_BROKEN",
    "InjectorError",
    "PreflightError",
    "ScenarioError",
    "StreamquakeError",
    "TargetError",
    "__version__",
]
