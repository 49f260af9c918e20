"""SLO verdicts: each SLO in each scored phase, and recovery measured against baseline.

Every SLO is evaluated in every scored phase so the report shows the damage everywhere; it
only *gates* (sets the exit code) in the phases it lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from streamquake.loadgen.metrics import NOT_MEASURABLE
from streamquake.loadgen.quantile_ci import min_samples_for_upper_bound
from streamquake.result import Check, RecoveryTime
from streamquake.scenario import HIGHER_IS_BETTER, RecoverySpec, Scenario, SLOSpec
from streamquake.scenario.schema import RECOVERY_TIME, VerdictSpec


class PhaseStats(Protocol):
    def percentile(self, metric: str, p: float) -> float | None: ...

    def percentile_bound(self, metric: str, p: float) -> tuple[float | None, bool]: ...

    def censored_count(self, metric: str) -> int: ...

    def percentile_interval(self, metric: str, p: float, confidence: float
                            ) -> tuple[float | None, float | None, int]: ...

    def rate_interval(self, metric: str, confidence: float
                      ) -> tuple[float | None, float | None, int]: ...

    def effective_count(self, metric: str, p: float | None, confidence: float) -> int: ...

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


def needed(op: str, percentile: float | None, low: float | None, high: float | None,
           confidence: float) -> int | None:
    """For a percentile that no observed value bounds on the limit's side: the fewest
    independent values that would bound it there."""
    if percentile is None or (high if op == "<=" else low) is not None:
        return None
    p = percentile / 100
    return min_samples_for_upper_bound(p if op == "<=" else 1 - p, confidence)


def check_slo(slo: SLOSpec, phase: str, stats: PhaseStats, cls: str | None = None,
              verdicts: VerdictSpec | None = None, kind: str | None = None) -> Check:
    """``slo`` in the step ``phase`` (of ``kind``; a phase is the step named as its kind)."""
    verdicts = verdicts or VerdictSpec()
    observed = observe(stats, slo.metric, slo.percentile)
    # A percentile that censored values (cut off by the timeout) could move is known only as
    # a lower bound: it can show a limit broken, never met.
    at_least = slo.percentile is not None and not stats.percentile_bound(
        slo.metric, slo.percentile)[1]
    if slo.max is not None:
        op, threshold = "<=", slo.max
        passed = observed is not None and observed <= threshold and not at_least
    else:
        assert slo.min is not None
        op, threshold = ">=", slo.min
        passed = observed is not None and observed >= threshold
    low, high, n = interval(stats, slo.metric, slo.percentile, verdicts.confidence)
    certain = sure(op, threshold, low, high) if observed is not None else True
    why = "" if observed is not None else (
        stats.unavailable(slo.metric) or "no data: no successful request in this phase")
    if at_least:
        why = (f"at least {observed:.1f}: {stats.censored_count(slo.metric)} of {n} values "
               "were cut off by the request timeout, so the percentile is known only as a "
               "lower bound")
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
        gating=phase in slo.phases or (kind or phase) in slo.phases,
        cls=cls,
        percentile=slo.percentile,
        detail=why,
        samples=n,
        effective_samples=stats.effective_count(slo.metric, slo.percentile,
                                                verdicts.confidence) if n else None,
        ci_low=low,
        ci_high=high,
        confidence=verdicts.confidence,
        inconclusive=certain is None,
        samples_needed=needed(op, slo.percentile, low, high, verdicts.confidence)
        if certain is None else None,
        measurable=measurable,
        at_least=at_least,
    )


def check_recovery(spec: RecoverySpec, baseline: PhaseStats, recovery: PhaseStats,
                   verdicts: VerdictSpec | None = None, after: str = "recovery",
                   before: str = "baseline", judges: str | None = None) -> list[Check]:
    """The recovery step ``after`` against the baseline step ``before``; ``judges``: the fault
    step between them, when the timeline has steps (None for ``phases:``)."""
    verdicts = verdicts or VerdictSpec()
    checks = []
    for metric in spec.metrics:
        base = baseline.percentile(metric, spec.percentile)
        seen = recovery.percentile(metric, spec.percentile)
        b_low, b_high, b_n = baseline.percentile_interval(metric, spec.percentile,
                                                          verdicts.confidence)
        low, high, n = recovery.percentile_interval(metric, spec.percentile,
                                                    verdicts.confidence)
        op = ">=" if metric in HIGHER_IS_BETTER else "<="
        threshold = _limit(spec, op, base)
        passed = seen is not None and threshold is not None and (
            seen >= threshold if op == ">=" else seen <= threshold)
        certain: bool | None = True
        if threshold is not None and seen is not None:
            # Baseline is measured too, so the threshold has an interval of its own: sure only
            # when seen - threshold is, by both intervals (a lucky baseline decides nothing).
            gap_low, gap_high = _gap_interval(seen, low, high, threshold,
                                              _limit(spec, op, b_low), _limit(spec, op, b_high))
            certain = sure(op, 0.0, gap_low, gap_high)
        tol = f"{spec.tolerance * 100:g}%"
        conf = f"{verdicts.confidence * 100:g}%"
        b_eff = baseline.effective_count(metric, spec.percentile, verdicts.confidence)
        eff = recovery.effective_count(metric, spec.percentile, verdicts.confidence)
        checks.append(
            Check(
                name=f"{metric} p{spec.percentile:g} recovers to baseline +{tol}",
                kind="recovery",
                phase=after,
                judges=judges,
                metric=metric,
                op=op,
                threshold=threshold if threshold is not None else float("nan"),
                observed=seen,
                passed=gate(passed, certain, verdicts.inconclusive),
                gating=True,
                percentile=spec.percentile,
                detail=(
                    f"{_pair(judges)}{before} {base:.1f} ({_count(b_n, b_eff)}, "
                    f"{conf} CI {_span(b_low, b_high)}); {after} {_count(n, eff)}, {conf} CI "
                    f"{_span(low, high)}"
                    if base is not None else
                    f"{_pair(judges)}no {before} data to compare"
                ),
                samples=n,
                effective_samples=eff if n else None,
                ci_low=low,
                ci_high=high,
                confidence=verdicts.confidence,
                inconclusive=certain is None,
                samples_needed=needed(op, spec.percentile, low, high, verdicts.confidence)
                if certain is None else None,
            )
        )
    return checks


def _pair(judges: str | None) -> str:
    return f"after {judges}: " if judges is not None else ""


def recovery_limit(spec: RecoverySpec, metric: str, base: float | None) -> float | None:
    """The limit that a baseline percentile of ``base`` sets for ``metric`` in recovery."""
    return _limit(spec, ">=" if metric in HIGHER_IS_BETTER else "<=", base)


def check_recovery_time(slo: SLOSpec, rt: RecoveryTime, kind: str,
                        verdicts: VerdictSpec | None = None, judges: str | None = None) -> Check:
    """``slo`` on ``recovery_time_s`` for one judged fault, from the interval its windows allow
    (run/recovery_time.py): met when the latest time meets the limit, broken when the earliest
    breaks it or the service is shown not back at the step's end, otherwise inconclusive. The
    time itself comes from windows too short to bound it, so an inconclusive one breaks nothing
    unless the scenario's ``verdicts.inconclusive`` is ``fail``."""
    verdicts = verdicts or VerdictSpec()
    op, threshold = ("<=", slo.max) if slo.max is not None else (">=", slo.min)
    assert threshold is not None
    seen = rt.time_s if rt.recovered else None
    certain = False if rt.not_recovered else sure(op, threshold, rt.earliest_s, rt.latest_s)
    passed = certain if certain is not None else verdicts.inconclusive != "fail"
    measurable = not rt.detail
    if not measurable:
        passed, certain = verdicts.unmeasurable != "fail", True
    return Check(name=slo.label, kind="slo", phase=rt.after, metric=slo.metric, op=op,
                 threshold=threshold, observed=seen, passed=passed,
                 gating=rt.after in slo.phases or kind in slo.phases,
                 detail=f"{NOT_MEASURABLE}: {rt.detail}" if rt.detail else
                 f"after {rt.step}: {rt.text}",
                 samples=rt.requests, measurable=measurable, judges=judges,
                 ci_low=rt.earliest_s, ci_high=rt.latest_s, confidence=rt.confidence,
                 inconclusive=certain is None)


def _limit(spec: RecoverySpec, op: str, base: float | None) -> float | None:
    """The threshold that a baseline percentile of ``base`` sets."""
    if base is None:
        return None
    if op == ">=":
        return base * (1.0 - spec.tolerance)
    return base * (1.0 + spec.tolerance) + spec.slack_ms


def _gap_interval(seen: float, low: float | None, high: float | None, threshold: float,
                  t_low: float | None, t_high: float | None
                  ) -> tuple[float | None, float | None]:
    """An interval for seen - threshold from the intervals of the two independent estimates
    (MOVER, Zou and Donner 2008: each side's distances to the estimates, in quadrature)."""
    gap = seen - threshold
    below = None if low is None or t_high is None else \
        gap - math.hypot(seen - low, t_high - threshold)
    above = None if high is None or t_low is None else \
        gap + math.hypot(high - seen, threshold - t_low)
    return below, above


def _count(n: int, effective: int) -> str:
    """``n=1606``, or ``n=1606, worth 127 independent`` when they depend on each other."""
    return f"n={n}" if effective >= n else f"n={n}, worth {effective} independent"


def _span(low: float | None, high: float | None) -> str:
    def side(v: float | None) -> str:
        return "unbounded" if v is None else f"{v:.1f}"

    return f"{side(low)}-{side(high)}"


def evaluate(
    scenario: Scenario,
    phases: Mapping[str, PhaseStats],
    classes: Mapping[str, Mapping[str, PhaseStats]],
    recovery_times: Sequence[RecoveryTime] = (),
) -> list[Check]:
    """All checks for a run. ``phases`` maps phase -> stats; ``classes`` phase -> class -> stats;
    ``recovery_times``: one per judged fault (an SLO on ``recovery_time_s`` judges each)."""
    checks: list[Check] = []
    scored = [(s.name, s.kind) for s in scenario.timeline
              if s.kind != "warmup" and s.name in phases]
    for slo in scenario.slos:
        if slo.metric == RECOVERY_TIME:
            checks.extend(check_recovery_time(
                slo, rt, step.kind if (step := scenario.step(rt.after)) else rt.after,
                scenario.verdicts, rt.step if scenario.steps is not None else None)
                for rt in recovery_times)
            continue
        checks.extend(check_slo(slo, name, phases[name], verdicts=scenario.verdicts, kind=kind)
                      for name, kind in scored)
    for rc in scenario.load.classes:
        for slo in rc.slos:
            if slo.metric == RECOVERY_TIME:
                continue       # one time per fault, not per class
            for name, kind in scored:
                cls_stats = classes.get(name, {}).get(rc.name)
                if cls_stats is not None:
                    checks.append(check_slo(slo, name, cls_stats, cls=rc.name,
                                            verdicts=scenario.verdicts, kind=kind))
    if scenario.recovery is None:
        return checks
    if scenario.steps is None:
        # phases: recovery against baseline, whatever the fault phase (even 0 s long).
        pairs: list[tuple[str, str, str | None]] = [("baseline", "recovery", None)]
    else:
        pairs = [(before.name, after.name, step.name)
                 for before, step, after in scenario.judged
                 if before is not None and after is not None]
    for before_name, after_name, judges in pairs:
        if before_name in phases and after_name in phases:
            checks.extend(check_recovery(scenario.recovery, phases[before_name],
                                         phases[after_name], scenario.verdicts,
                                         after=after_name, before=before_name, judges=judges))
    return checks
