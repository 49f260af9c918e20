"""Scenarios: the schema (``schema``) and the YAML loader with line numbers (``loader``)."""

from streamquake.scenario.loader import load_scenario, parse_scenario
from streamquake.scenario.schema import (
    HIGHER_IS_BETTER,
    HISTOGRAM_METRICS,
    PHASE_ORDER,
    RATE_METRICS,
    SCORED_PHASES,
    FaultModel,
    LoadSpec,
    PhasesSpec,
    RecoverySpec,
    RequestClass,
    Scenario,
    SLOSpec,
    TargetSpec,
)

__all__ = [
    "HIGHER_IS_BETTER", "HISTOGRAM_METRICS", "PHASE_ORDER", "RATE_METRICS", "SCORED_PHASES",
    "FaultModel", "LoadSpec", "PhasesSpec", "RecoverySpec", "RequestClass",
    "SLOSpec", "Scenario", "TargetSpec", "load_scenario", "parse_scenario",
]
