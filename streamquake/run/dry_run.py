"""`run --dry-run`: what a run would change, where, and how it would be undone, from the scenario
alone. It starts nothing and changes nothing."""

from __future__ import annotations

import itertools

from streamquake.faults.catalog import families, fault_type
from streamquake.faults.envelope import FaultSpec
from streamquake.faults.written import written_pairs
from streamquake.journal import journal_path
from streamquake.run.parts import wanted_resources
from streamquake.scenario import Scenario
from streamquake.scenario.steps import Ramp, StepSpec


def _params(spec: FaultSpec) -> str:
    return ", ".join(f"{k}={v}" for k, v in written_pairs(spec)) or "defaults"


def _line(spec: FaultSpec, scenario: Scenario, when: str) -> str:
    ft = fault_type(spec.type)
    where = ft.where(spec, scenario) if ft.where else "as its family does"
    at = f" via agent {spec.at}" if spec.at else ""
    flap = spec.flap
    if flap is not None:    # switched at its edges (run/flapping.py), each journalled
        about = "" if flap.fixed else "~"
        at += (f", flapping on {about}{flap.typical_s('on'):g}s / off "
               f"{about}{flap.typical_s('off'):g}s" + ("" if flap.fixed else
                                                        f" ({flap.distribution})"))
    return f"{when}: {spec.type} '{spec.label}'{at} ({_params(spec)}); {where}"


def dry_run_plan(scenario: Scenario) -> list[str]:
    lines = [f"dry run of '{scenario.name}': nothing is started or changed"]
    target = scenario.target
    if target.embedded is not None:
        home = ("in its own network namespace sq-<id> behind a veth pair in 10.213.0.0/16 "
                "(journalled; removed on every exit and by `streamquake recover`)"
                if scenario.network.mode == "namespace" else "on 127.0.0.1, a free port")
        lines.append(f"target: the embedded {target.protocol} server, {home}")
    else:
        lines.append(f"target: {target.url} (only this address receives load)")
    for r in wanted_resources(scenario):
        lines.append(f"for the whole run: {r.title}; stopped on every exit path")
    load = scenario.load
    shape = (f"open loop at {load.arrival.rate_per_s:g}/s" if load.arrival
             else f"{load.users} users, closed loop")
    lines.append(f"load: {shape}, {scenario.total_s:g} s in all, then it stops")
    for fam in families():
        for spec in fam.implied(scenario):
            lines.append(_line(spec, scenario, "whole run"))
    if scenario.steps is not None:
        return lines + _steps_plan(scenario)
    offset = 0.0
    by_label = {f.label: f for f in scenario.faults}
    for step in scenario.timeline:
        length = step.duration_s
        for name in step.faults:
            when = f"+{offset:g}s to +{offset + length:g}s ({step.name})"
            lines.append(_line(by_label[name], scenario, when))
        offset += length
    lines.append(f"every change is journalled first in {journal_path()} and reverted at its "
                 "phase's end, on failure, Ctrl-C and SIGTERM; after a kill, `streamquake "
                 "recover` undoes it")
    return lines


def _steps_plan(scenario: Scenario) -> list[str]:
    """Each step in turn, with the faults it applies (once for consecutive steps that name a
    fault: it is held across them), when each is reverted, and what an abort does."""
    steps = scenario.timeline
    starts = list(itertools.accumulate((s.duration_s for s in steps), initial=0.0))
    by_label = {f.label: f for f in scenario.faults}
    lines = []
    for i, step in enumerate(steps):
        lines.append(f"step {step.name} ({step.kind}): +{starts[i]:g}s to "
                     f"+{starts[i + 1]:g}s{_step_load(step)}")
        for name in step.faults:
            if i > 0 and name in steps[i - 1].faults:
                lines.append(f"  '{name}' stays applied from {steps[i - 1].name}")
                continue
            last = i
            while last + 1 < len(steps) and name in steps[last + 1].faults:
                last += 1
            held = ", ".join(s.name for s in steps[i:last + 1])
            end = starts[last + 1]
            undone = (f"reverted at +{end:g}s as {steps[last + 1].name} begins"
                      if last + 1 < len(steps) else f"reverted at +{end:g}s, the end of the run")
            lines.append("  " + _line(by_label[name], scenario,
                                      f"+{starts[i]:g}s to +{end:g}s ({held})") + f"; {undone}")
    for cond in scenario.abort_when:
        lines.append(f"abort when {cond.label}: every fault is reverted at once, the fault "
                     "steps still to come run without their faults (skipped: no verdict), the "
                     "other steps, recovery among them, still run and are reported (exit 5)")
    lines.append(f"every change is journalled first in {journal_path()} and reverted at the "
                 "end of the last consecutive step that names it, on failure, Ctrl-C and "
                 "SIGTERM; after a kill, `streamquake recover` undoes it")
    return lines


def _step_load(step: StepSpec) -> str:
    load = step.load
    if load is None:
        return ""
    if load.users is not None:
        return f", {load.users} users"
    rate = load.rate
    said = (f", {rate.start:g}/s ramping to {rate.end:g}/s" if isinstance(rate, Ramp)
            else f", {rate:g}/s")
    if load.spike is not None:
        said += (f", a spike to {load.spike.rate:g}/s from +{load.spike.at_s:g}s for "
                 f"{load.spike.for_s:g}s")
    return said
