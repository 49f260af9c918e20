"""SLO verdicts: each SLO in each scored phase, and recovery measured against baseline.

Every SLO is evaluated in every scored phase so the report shows the damage everywhere; it
only *gates* (sets the exit code) in the phases it lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from streamquake.loadgen.metrics import NOT_MEASURABLE
from streamquake.result import Check
from streamquake.scenario import HIGHER_IS_BETTER, SCORED_PHASES, RecoverySpec, Scenario, SLOSpec
from streamquake.scenario.schema import VerdictSpec


class PhaseStats(Protocol):
    def percentile(self, metric: str, p: float) -> float | None: ...

    def percentile_interval(self, metric: str, p: float, confidence: float
                            ) -> tuple[float | None, float | None, int]: ...

    def rate_interval(self, metric: str, confidence: float
                      ) -> tuple[float | None, float | None, int]: ...

    def value(self, metric: str) -> float | None: ...

    def unavailable(self, metric: str) -> str | None: ...


def observe(stats: PhaseStats, metric: str, percentile: float | None) -> float | None:
    if percentile is not None:
        return stats.percentile(metric, percentile)
    return stats.value(metric)


def interval(stats: PhaseStats, metric: str, percentile: float | None,
             confidence: float) -> tuple[float | None, float | None, int]:
    if percentile is not None:
        return stats.percentile_interval(metric, percentile, confidence)
    return stats.rate_interval(metric, confidence)


def sure(op: str, threshold: float, low: float | None, high: float | None) -> bool | None:
    """True: the whole interval meets the threshold; False: it all breaks it; None: it
    straddles the threshold, or a side cannot be bounded with so few samples."""
    if op == "<=":
        if high is not None and high <= threshold:
            return True
        return False if low is not None and low > threshold else None
    if low is not None and low >= threshold:
        return True
    return False if high is not None and high < threshold else None


def gate(point: bool, certain: bool | None, policy: str) -> bool:
    if certain is not None or policy == "warn":
        return point
    return policy == "pass"


def check_slo(slo: SLOSpec, phase: str, stats: PhaseStats, cls: str | None = None,
              verdicts: VerdictSpec | None = None) -> Check:
    verdicts = verdicts or VerdictSpec()
    observed = observe(stats, slo.metric, slo.percentile)
    if slo.max is not None:
        op, threshold = "<=", slo.max
        passed = observed is not None and observed <= threshold
    else:
        assert slo.min is not None
        op, threshold = ">=", slo.min
        passed = observed is not None and observed >= threshold
    low, high, n = interval(stats, slo.metric, slo.percentile, verdicts.confidence)
    certain = sure(op, threshold, low, high) if observed is not None else True
    why = "" if observed is not None else (
        stats.unavailable(slo.metric) or "no data: no successful request in this phase")
    measurable = not why.startswith(NOT_MEASURABLE)
    if not measurable:
        passed = verdicts.unmeasurable != "fail"
    return Check(
        name=slo.label,
        kind="slo",
        phase=phase,
        metric=slo.metric,
        op=op,
        threshold=threshold,
        observed=observed,
        passed=gate(passed, certain, verdicts.inconclusive),
        gating=phase in slo.phases,
        cls=cls,
        percentile=slo.percentile,
        detail=why,
        samples=n,
        ci_low=low,
        ci_high=high,
        confidence=verdicts.confidence,
        inconclusive=certain is None,
        measurable=measurable,
    )


def check_recovery(spec: RecoverySpec, baseline: PhaseStats, recovery: PhaseStats,
                   verdicts: VerdictSpec | None = None) -> list[Check]:
    verdicts = verdicts or VerdictSpec()
    checks = []
    for metric in spec.metrics:
        base = baseline.percentile(metric, spec.percentile)
        seen = recovery.percentile(metric, spec.percentile)
        b_low, b_high, b_n = baseline.percentile_interval(metric, spec.percentile,
                                                          verdicts.confidence)
        low, high, n = recovery.percentile_interval(metric, spec.percentile,
                                                    verdicts.confidence)
        if metric in HIGHER_IS_BETTER:
            op = ">="
            threshold = None if base is None else base * (1.0 - spec.tolerance)
            passed = seen is not None and threshold is not None and seen >= threshold
        else:
            op = "<="
            threshold = None if base is None else base * (1.0 + spec.tolerance) + spec.slack_ms
            passed = seen is not None and threshold is not None and seen <= threshold
        tol = f"{spec.tolerance * 100:g}%"
        certain = (sure(op, threshold, low, high)
                   if threshold is not None and seen is not None else True)
        conf = f"{verdicts.confidence * 100:g}%"
        checks.append(
            Check(
                name=f"{metric} p{spec.percentile:g} recovers to baseline +{tol}",
                kind="recovery",
                phase="recovery",
                metric=metric,
                op=op,
                threshold=threshold if threshold is not None else float("nan"),
                observed=seen,
                passed=gate(passed, certain, verdicts.inconclusive),
                gating=True,
                percentile=spec.percentile,
                detail=(
                    f"baseline {base:.1f} (n={b_n}, {conf} CI {_span(b_low, b_high)}); "
                    f"recovery n={n}, {conf} CI {_span(low, high)}"
                    if base is not None else "no baseline data to compare"
                ),
                samples=n,
                ci_low=low,
                ci_high=high,
                confidence=verdicts.confidence,
                inconclusive=certain is None,
            )
        )
    return checks


def _span(low: float | None, high: float | None) -> str:
    def side(v: float | None) -> str:
        return "unbounded" if v is None else f"{v:.1f}"

    return f"{side(low)}-{side(high)}"


def evaluate(
    scenario: Scenario,
    phases: Mapping[str, PhaseStats],
    classes: Mapping[str, Mapping[str, PhaseStats]],
) -> list[Check]:
    """All checks for a run. ``phases`` maps phase -> stats; ``classes`` phase -> class -> stats."""
    checks: list[Check] = []
    scored = [p for p in SCORED_PHASES if p in phases]
    for slo in scenario.slos:
        checks.extend(check_slo(slo, phase, phases[phase], verdicts=scenario.verdicts)
                      for phase in scored)
    for rc in scenario.load.classes:
        for slo in rc.slos:
            for phase in scored:
                cls_stats = classes.get(phase, {}).get(rc.name)
                if cls_stats is not None:
                    checks.append(check_slo(slo, phase, cls_stats, cls=rc.name,
                                            verdicts=scenario.verdicts))
    if scenario.recovery is not None and "baseline" in phases and "recovery" in phases:
        checks.extend(check_recovery(scenario.recovery, phases["baseline"], phases["recovery"],
                                     scenario.verdicts))
    return checks
