"""Capacity under fault: the highest arrival rate at which the scenario's SLOs still hold, with
no fault and then with each fault held alone, and the share of that capacity each fault leaves.

Each probe is a run of the product's own runner on a scenario derived from the user's: an open
loop at the probed rate, a short warm-up, one measured step with the condition's fault held, and
every SLO of the scenario judged in that step. The search grows (or shrinks) the rate
geometrically until it has a conclusive pass and a conclusive failure, then bisects (geometric
mean) between the highest pass below the lowest failure and that failure. An inconclusive probe
narrows nothing: it is repeated once with twice the warm-up and measured time (an unstable
queue grows for longer, a stable one gives more samples), and inconclusive again ends the search
there. Each condition stops at the asked precision, at ``max_probes``, or when its
share of the time budget would not hold another probe (the last probe's length says how long
one takes), so the whole search ends within the budget and at most one probe's misjudged length.

Each probe also counts its goodput (the requests that met every per-request SLO) and each
condition has a knee, the probed rate beyond which goodput falls behind the offered rate
(run/goodput.py): the capacity judges percentiles at a confidence, the knee what share of
requests got an answer within every SLO.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from streamquake.errors import EXIT_REVERT_FAILED, ScenarioError
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.tail import SampleTail
from streamquake.result import Check, RunResult
from streamquake.run.events import Events
from streamquake.run.goodput import (
    Goodput,
    Knee,
    RequestSLO,
    goodput_of,
    knee_of,
    request_slos,
    rule_text,
)
from streamquake.run.runner import Runner
from streamquake.run.verdicts import needed
from streamquake.scenario import Scenario

Verdict = Literal["pass", "fail", "inconclusive"]
BEFORE, WARM, MEASURE = "before", "warm", "measure"     # the probe scenario's steps
BEFORE_S = 1.0             # the baseline step a fault step needs before it
NO_FAULT = "no fault"
FIRST_OVERHEAD_S = 15.0    # a probe's time beyond its steps (target, load processes, drain),
                           # until the first probe says how long one takes here
MIN_REQUESTS = 20         # a probe that would send fewer in its measured step says nothing
SENT_SHARE = 0.9           # a probe that sent less than this share of its rate measured
                           # the load generator, not the target: inconclusive


@dataclass(frozen=True)
class SearchPlan:
    """What ``capacity`` was asked, flags already checked."""

    faults: tuple[str, ...] | None = None      # None: each fault of the scenario
    start: float | None = None                 # requests/s; None: the scenario's rate, or 1
    growth: float = 2.0
    precision: float = 0.10                    # stop when lowest failure / highest pass - 1
    max_probes: int = 10                       # each condition
    budget_s: float = 600.0                    # all conditions together
    warmup_s: float = 5.0
    probe_s: float = 20.0                      # each probe's measured step
    lease_s: float | None = 10.0


@dataclass
class ProbeCheck:
    """One SLO in a probe's measured step."""

    name: str
    metric: str
    op: str
    threshold: float
    observed: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: Verdict


@dataclass
class Probe:
    rate: float                    # requests/s asked
    measured_s: float
    sent_per_s: float
    answered_per_s: float | None   # successful streams that ended in the measured step, per
                                   #   second (None: load.samples is none)
    verdict: Verdict
    why: str
    checks: list[ProbeCheck] = field(default_factory=list)
    goodput: Goodput | None = None  # of the requests due in the measured step (None:
                                    #   load.samples is none)
    wall_s: float = 0.0
    out: str = ""


@dataclass
class Condition:
    name: str                      # "no fault", or the fault held
    fault: str | None
    probes: list[Probe] = field(default_factory=list)
    stopped: str = ""

    @property
    def high(self) -> float | None:
        """The lowest rate with a conclusive failure."""
        return min((p.rate for p in self.probes if p.verdict == "fail"), default=None)

    @property
    def low(self) -> float | None:
        """The highest rate with a conclusive pass below ``high``."""
        high = self.high
        return max((p.rate for p in self.probes if p.verdict == "pass"
                    and (high is None or p.rate < high)), default=None)

    @property
    def estimate(self) -> float | None:
        """The bracket's geometric middle (None until both ends are found)."""
        low, high = self.low, self.high
        return math.sqrt(low * high) if low is not None and high is not None else None

    @property
    def knee(self) -> Knee:
        """Where goodput stops growing with the offered rate (run/goodput.py), over the
        probes whose load generator sent the rate asked (the others measured it, not the
        target)."""
        return knee_of((p.rate, p.goodput) for p in self.probes if p.goodput is not None
                       and p.sent_per_s >= SENT_SHARE * p.rate)

    @property
    def contradictions(self) -> list[Probe]:
        """Passes above the lowest failure: the SLO is noisy near the capacity."""
        high = self.high
        return [p for p in self.probes if p.verdict == "pass" and high is not None
                and p.rate >= high]

    def sureness(self, confidence: float) -> str:
        """How sure the bracket is, in words."""
        low, high = self.low, self.high
        n, unsure = len(self.probes), sum(p.verdict == "inconclusive" for p in self.probes)
        level = f"each end a verdict at {confidence:.0%} confidence"
        if low is not None and high is not None:
            text = (f"between {low:.3g} and {high:.3g} requests/s (±{(high / low - 1) / 2:.0%}"
                    f"; {level})")
        elif low is not None:
            text = f"at least {low:.3g} requests/s: no rate failed"
        elif high is not None:
            text = f"below {high:.3g} requests/s: no rate passed"
        else:
            text = "not found: no probe was conclusive"
        text += f"; {n} probe{'s' * (n != 1)}, {unsure} inconclusive"
        if self.contradictions:
            text += (f"; {len(self.contradictions)} passed above the lowest failure (the SLO "
                     "is noisy near the capacity)")
        return text


@dataclass
class Loss:
    """What a fault leaves of the no-fault capacity: a ratio and the interval the two brackets
    allow (its fault bracket over the no-fault one)."""

    fault: str
    ratio: float | None
    low: float | None
    high: float | None

    @property
    def text(self) -> str:
        if self.ratio is None:
            return f"{self.fault}: not known (a capacity without both bracket ends)"
        between = (f" (between {self.low:.0%} and {self.high:.0%})"
                   if self.low is not None and self.high is not None else "")
        return f"{self.fault}: {self.ratio:.0%} of the no-fault capacity{between}"


@dataclass
class CapacityResult:
    scenario_name: str
    scenario_file: str
    metric_note: str               # which SLOs a probe must hold
    confidence: float
    precision: float
    started_at: float
    finished_at: float = 0.0
    conditions: list[Condition] = field(default_factory=list)
    interrupted: str | None = None
    exit_code: int = 0
    goodput_rule: str = ""         # what a request must do to count as goodput, in words

    @property
    def losses(self) -> list[Loss]:
        base = next((c for c in self.conditions if c.fault is None), None)
        out = []
        for c in self.conditions:
            if c.fault is None or base is None:
                continue
            ratio = (c.estimate / base.estimate if c.estimate is not None
                     and base.estimate is not None else None)
            lo = c.low / base.high if c.low is not None and base.high is not None else None
            hi = c.high / base.low if c.high is not None and base.low is not None else None
            out.append(Loss(c.name, ratio, lo, hi))
        return out


def next_probe(probes: list[Probe], start: float, growth: float, precision: float
               ) -> tuple[float, float] | str:
    """(the next rate, its warm-up and measured time as a factor of the usual), or why the
    search is done.
    Grow (or shrink) by ``growth`` until both a pass and a failure are found, then bisect."""
    if not probes:
        return start, 1.0
    last = probes[-1]
    if last.verdict == "inconclusive":
        if sum(p.rate == last.rate and p.verdict == "inconclusive" for p in probes) < 2:
            return last.rate, 2.0
        return (f"inconclusive twice at {last.rate:.3g} requests/s (the SLO sits near its "
                "threshold there; no verdict narrowed the bracket)")
    cond = Condition("", None, probes)
    low, high = cond.low, cond.high
    if low is not None and high is not None:
        if high / low - 1 <= precision:
            return f"bracket within {precision:.0%}"
        return math.sqrt(low * high), 1.0
    if low is not None:
        return low * growth, 1.0
    assert high is not None
    return high / growth, 1.0


def probe_scenario(scenario: Scenario, rate: float, fault: str | None, warmup_s: float,
                   measure_s: float) -> Scenario:
    """``scenario`` as one probe: an open loop at ``rate``, a warm-up and one measured step with
    ``fault`` (a fault's name) held from the warm-up on, every SLO judged in the measured step,
    no recovery checks."""
    doc: dict[str, Any] = scenario.model_dump(by_alias=True, exclude_unset=True, mode="json")
    load: dict[str, Any] = doc.setdefault("load", {})
    load.pop("think_time", None)
    arrival = scenario.load.arrival
    load["arrival"] = {"rate": rate, "process": arrival.process if arrival else "poisson",
                       **({"max_inflight": arrival.max_inflight} if arrival else {})}
    faults = [{k: v for k, v in d.items() if k != "phase"}
              for spec, d in zip(scenario.faults, doc.get("faults", []), strict=True)
              if spec.label == fault]
    doc["faults"] = faults
    doc.pop("phases", None)
    doc.pop("recovery", None)
    held = [fault] if fault else []
    # A fault step comes after a baseline step (the timeline's rule); the fault is held from
    # the warm-up on, so an unstable queue builds up under it.
    doc["steps"] = [{"name": BEFORE, "kind": "baseline", "duration": BEFORE_S}] if fault else []
    doc["steps"] += [
        {"name": WARM, "kind": "fault" if fault else "warmup", "duration": warmup_s,
         "faults": held},
        {"name": MEASURE, "kind": "fault" if fault else "baseline", "duration": measure_s,
         "faults": held}]
    for slo in [*doc.get("slos", []), *(s for c in load.get("classes", [])
                                        for s in c.get("slos", []))]:
        slo["phases"] = [MEASURE]
    return Scenario.model_validate(doc)


def _checks(result: RunResult) -> list[Check]:
    return [c for c in result.checks if c.kind == "slo" and c.phase == MEASURE and c.ran
            and c.measurable]


def _check_verdict(c: Check) -> Verdict:
    # A timing the load generator's saturation distorted says nothing of the target.
    return "inconclusive" if c.inconclusive or c.not_judged else "pass" if c.passed else "fail"


def _answered(samples: list[RequestSample], start: float, end: float) -> float:
    """Successful streams (from any step) that ended in [start, end), per second."""
    ended = sum(1 for s in samples
                if s.error is None and not s.retried and not s.cancelled
                and s.e2e_ms is not None
                and start <= s.sent + s.e2e_ms / 1000.0 < end)
    return ended / (end - start)


def judge_probe(result: RunResult, rate: float, work_dir: Path | None,
                policy: Literal["warn", "fail", "pass"] = "warn",
                slos: Sequence[RequestSLO] = ()) -> Probe:
    """The probe's verdict from its run (``work_dir``: where its samples are; None: none were
    written): a conclusive failure of any SLO fails it; otherwise an error or a load generator
    that fell short of the rate makes it inconclusive, and so does an inconclusive SLO unless
    the scenario's ``verdicts.inconclusive`` (``policy``) gates it as a pass or a failure; else
    it passes. With its samples, its answered/s and its goodput against ``slos`` too."""
    step = next(p for p in result.phases if p.name == MEASURE)
    measured = step.end - step.start
    sent = step.stats.get("sent")
    sent_per_s = (sent if isinstance(sent, int | float) else 0) / measured
    checks = [ProbeCheck(c.name, c.metric, c.op, c.threshold, c.observed, c.ci_low,
                         c.ci_high, _check_verdict(c)) for c in _checks(result)]
    failed = [c for c in checks if c.verdict == "fail"]
    unsure = [c for c in checks if c.verdict == "inconclusive"]
    verdict: Verdict
    if result.aborted:
        verdict, why = "fail", f"aborted: {result.aborted}"
    elif result.failure or step.status != "complete":
        verdict, why = "inconclusive", result.failure or f"the step is {step.status}"
    elif sent_per_s < SENT_SHARE * rate:
        verdict, why = "inconclusive", (f"the load generator sent only {sent_per_s:.3g} of "
                                        f"{rate:.3g} requests/s")
    elif failed:
        verdict, why = "fail", "; ".join(_said(c) for c in failed)
    elif unsure and policy != "warn":
        verdict = policy
        why = (f"inconclusive, gated as {policy} by verdicts.inconclusive: "
               + "; ".join(_said(c) for c in unsure))
    elif unsure:
        verdict, why = "inconclusive", "; ".join(_said(c) for c in unsure)
    elif not checks:
        verdict, why = "inconclusive", "no SLO could be measured"
    else:
        verdict, why = "pass", "; ".join(_said(c) for c in checks)
    if work_dir is None:
        return Probe(rate, measured, sent_per_s, None, verdict, why, checks)
    samples = SampleTail(work_dir / "samples").poll()
    return Probe(rate, measured, sent_per_s, _answered(samples, step.start, step.end), verdict,
                 why, checks, goodput_of(samples, step.start, step.end, slos))


def _said(c: ProbeCheck) -> str:
    if c.observed is None:
        return f"{c.name}: no value"
    ci = (f" [{value_text(c.ci_low)}, {value_text(c.ci_high)}]" if c.ci_low is not None
          or c.ci_high is not None else "")
    return f"{c.name}: {value_text(c.observed)}{ci}"


def value_text(value: float | None) -> str:
    """A probe's SLO value or bound, in 3 figures."""
    if value is None:
        return "?"
    return "0" if abs(value) < 1e-9 else f"{value:.3g}"    # not 3.47e-18: rounding's dust


INDEPENDENCE = 2.0   # requests a percentile's batch-means count as one independent value
                     # (n=36 were "worth 13 independent" in a short run), so to spare


def values_for(scenario: Scenario) -> float:
    """Requests a probe's measured step needs for its strictest percentile SLO to be bounded
    on its limit's side (0 with none); a class's SLO sees only its share of the requests."""
    total = sum(c.weight for c in scenario.load.classes) or 1.0
    slos = [(s, 1.0) for s in scenario.slos]
    slos += [(s, c.weight / total) for c in scenario.load.classes for s in c.slos]
    needs = [n / share for s, share in slos if share > 0 and (n := needed(
        "<=" if s.max is not None else ">=", s.percentile, None, None,
        scenario.verdicts.confidence)) is not None]
    return INDEPENDENCE * max(needs, default=0.0)


def probe_lengths(scenario: Scenario, plan: SearchPlan, rate: float,
                  factor: float) -> tuple[float, float]:
    """A probe's warm-up and measured step at ``rate`` (``factor``: 2 for a repeat): the
    measured step is long enough for the strictest percentile SLO to be judged at all. A p95
    needs 72 independent values to be bounded at 95%: a 6 s probe at 4/s had 24, was
    inconclusive twice, and the search ended there, far below the capacity."""
    measure_s = max(plan.probe_s * factor, values_for(scenario) * factor / rate)
    return plan.warmup_s * factor, measure_s


def conditions_of(scenario: Scenario, asked: tuple[str, ...] | None) -> list[Condition]:
    """No fault first, then each asked fault (default: each of the scenario's) held alone."""
    names = [f.label for f in scenario.faults]
    unknown = [n for n in asked or () if n not in names]
    if unknown:
        raise ScenarioError(f"--fault {unknown[0]}: the scenario has no fault of that name "
                            f"(its faults: {', '.join(names) or 'none'})")
    return [Condition(NO_FAULT, None), *(Condition(n, n) for n in (asked or names))]


def check_searchable(scenario: Scenario) -> None:
    if scenario.load.trace is not None:
        raise ScenarioError("capacity searches an arrival rate, and load.trace sets its own "
                            "arrival times: remove load.trace")
    if not scenario.slos and not any(c.slos for c in scenario.load.classes):
        raise ScenarioError("capacity looks for the highest rate at which the scenario's SLOs "
                            "hold, and it has none: add slos (e.g. {metric: ttft_ms, "
                            "percentile: 95, max: 2s})")


def search_capacity(scenario: Scenario, scenario_file: str, out: Path, plan: SearchPlan,
                    say: Callable[[str], None]) -> CapacityResult:
    """Search each condition in turn; ``say`` hears one line a probe."""
    check_searchable(scenario)
    conditions = conditions_of(scenario, plan.faults)
    slos = ", ".join(s.label for s in scenario.slos) or "the classes' SLOs"
    result = CapacityResult(scenario.name, scenario_file, slos, scenario.verdicts.confidence,
                            plan.precision, time.time(),
                            goodput_rule=rule_text(request_slos(scenario)))
    deadline = result.started_at + plan.budget_s
    arrival = scenario.load.arrival
    start = plan.start or (arrival.rate_per_s if arrival is not None else 1.0)
    overhead_s = FIRST_OVERHEAD_S
    for i, cond in enumerate(conditions):
        result.conditions.append(cond)
        share_end = time.time() + (deadline - time.time()) / (len(conditions) - i)
        first = _first_rate(result.conditions[0], start, plan.growth) if i else start
        while True:
            step = next_probe(cond.probes, first, plan.growth, plan.precision)
            if isinstance(step, str):
                cond.stopped = step
                break
            rate, factor = step
            if len(cond.probes) >= plan.max_probes:
                cond.stopped = f"max probes ({plan.max_probes})"
                break
            warm_s, measure_s = probe_lengths(scenario, plan, rate, factor)
            if rate * measure_s < MIN_REQUESTS:
                cond.stopped = (f"{rate:.3g} requests/s would send under {MIN_REQUESTS} "
                                f"requests in a {measure_s:g} s probe: too few to judge")
                break
            if time.time() + overhead_s + BEFORE_S + warm_s + measure_s > share_end:
                cond.stopped = "the time budget"
                break
            probe, run = _probe(scenario, scenario_file, out, cond, rate, warm_s, measure_s,
                                plan.lease_s)
            overhead_s = max(0.0, probe.wall_s - BEFORE_S - warm_s - measure_s)
            cond.probes.append(probe)
            good = "" if probe.goodput is None else f"; goodput {probe.goodput.text}"
            say(f"{cond.name}: {rate:.3g} requests/s: {probe.verdict.upper()} "
                f"(sent {probe.sent_per_s:.3g}/s; {probe.why}{good})")
            if run.interrupted:
                result.interrupted, result.exit_code = run.interrupted, run.exit_code
                cond.stopped = f"interrupted ({run.interrupted})"
                result.finished_at = time.time()
                return result
            if run.exit_code == EXIT_REVERT_FAILED:
                # A fault may still be in place: every later probe would measure it too.
                result.exit_code = run.exit_code
                cond.stopped = "a fault could not be reverted (run `streamquake recover`)"
                result.finished_at = time.time()
                return result
        say(f"{cond.name}: capacity {cond.sureness(result.confidence)}; stopped: "
            f"{cond.stopped}; knee {cond.knee.text}")
    result.finished_at = time.time()
    return result


def _first_rate(base: Condition, start: float, growth: float) -> float:
    """A fault condition starts where the no-fault search ended."""
    if base.estimate is not None:
        return base.estimate
    if base.low is not None:
        return base.low
    return base.high / growth if base.high is not None else start


def _probe(scenario: Scenario, scenario_file: str, out: Path, cond: Condition, rate: float,
           warm_s: float, measure_s: float, lease_s: float | None) -> tuple[Probe, RunResult]:
    derived = probe_scenario(scenario, rate, cond.fault, warm_s, measure_s)
    slug = "no-fault" if cond.fault is None else f"fault-{cond.fault}"
    probe_out = out / "probes" / f"{slug}-{len(cond.probes) + 1:02d}"
    began = time.monotonic()
    runner = Runner(derived, scenario_file, probe_out, events=Events(), lease_s=lease_s)
    run = runner.run()
    probe = judge_probe(run, rate, runner.work_dir if derived.load.samples == "all" else None,
                        derived.verdicts.inconclusive, request_slos(derived))
    probe.wall_s, probe.out = time.monotonic() - began, str(probe_out)
    return probe, run
