"""SLO verdicts: each SLO in each scored phase, and recovery measured against baseline.

Every SLO is evaluated in every scored phase so the report shows the damage everywhere; it
only *gates* (sets the exit code) in the phases it lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from streamquake.result import Check
from streamquake.scenario import HIGHER_IS_BETTER, SCORED_PHASES, RecoverySpec, Scenario, SLOSpec


class PhaseStats(Protocol):
    def percentile(self, metric: str, p: float) -> float | None: ...

    def value(self, metric: str) -> float | None: ...

    def unavailable(self, metric: str) -> str | None: ...


def observe(stats: PhaseStats, metric: str, percentile: float | None) -> float | None:
    if percentile is not None:
        return stats.percentile(metric, percentile)
    return stats.value(metric)


def check_slo(slo: SLOSpec, phase: str, stats: PhaseStats, cls: str | None = None) -> Check:
    observed = observe(stats, slo.metric, slo.percentile)
    if slo.max is not None:
        op, threshold = "<=", slo.max
        passed = observed is not None and observed <= threshold
    else:
        assert slo.min is not None
        op, threshold = ">=", slo.min
        passed = observed is not None and observed >= threshold
    return Check(
        name=slo.label,
        kind="slo",
        phase=phase,
        metric=slo.metric,
        op=op,
        threshold=threshold,
        observed=observed,
        passed=passed,
        gating=phase in slo.phases,
        cls=cls,
        percentile=slo.percentile,
        detail="" if observed is not None else (
            stats.unavailable(slo.metric) or "no data: no successful request in this phase"),
    )


def check_recovery(spec: RecoverySpec, baseline: PhaseStats, recovery: PhaseStats) -> list[Check]:
    checks = []
    for metric in spec.metrics:
        base = baseline.percentile(metric, spec.percentile)
        seen = recovery.percentile(metric, spec.percentile)
        if metric in HIGHER_IS_BETTER:
            op = ">="
            threshold = None if base is None else base * (1.0 - spec.tolerance)
            passed = seen is not None and threshold is not None and seen >= threshold
        else:
            op = "<="
            threshold = None if base is None else base * (1.0 + spec.tolerance) + spec.slack_ms
            passed = seen is not None and threshold is not None and seen <= threshold
        tol = f"{spec.tolerance * 100:g}%"
        checks.append(
            Check(
                name=f"{metric} p{spec.percentile:g} recovers to baseline +{tol}",
                kind="recovery",
                phase="recovery",
                metric=metric,
                op=op,
                threshold=threshold if threshold is not None else float("nan"),
                observed=seen,
                passed=passed,
                gating=True,
                percentile=spec.percentile,
                detail=(
                    f"baseline {base:.1f}" if base is not None else "no baseline data to compare"
                ),
            )
        )
    return checks


def evaluate(
    scenario: Scenario,
    phases: Mapping[str, PhaseStats],
    classes: Mapping[str, Mapping[str, PhaseStats]],
) -> list[Check]:
    """All checks for a run. ``phases`` maps phase -> stats; ``classes`` phase -> class -> stats."""
    checks: list[Check] = []
    scored = [p for p in SCORED_PHASES if p in phases]
    for slo in scenario.slos:
        checks.extend(check_slo(slo, phase, phases[phase]) for phase in scored)
    for rc in scenario.load.classes:
        for slo in rc.slos:
            for phase in scored:
                cls_stats = classes.get(phase, {}).get(rc.name)
                if cls_stats is not None:
                    checks.append(check_slo(slo, phase, cls_stats, cls=rc.name))
    if scenario.recovery is not None and "baseline" in phases and "recovery" in phases:
        checks.extend(check_recovery(scenario.recovery, phases["baseline"], phases["recovery"]))
    return checks
