"""A run as a timeline of steps: ``steps:`` in a scenario, or the four ``phases:`` as the short
form of the same thing.

Each step has a unique ``name``, a ``kind`` (``warmup``, ``baseline``, ``fault``, ``recovery``),
a ``duration``, the faults active in it (by fault name) and optionally a load of its own: a user
count (closed loop), or an arrival rate (open loop), constant or ramping linearly from one value
to another over the step, with an optional spike::

    steps:
      - {name: warm, kind: warmup, duration: 5s}
      - {name: before-jitter, kind: baseline, duration: 20s}
      - {name: jitter, kind: fault, duration: 20s, faults: [cross-region-jitter]}
      - {name: after-jitter, kind: recovery, duration: 30s, load: {rate: {from: 5, to: 20}}}

``phases: {warmup, baseline, fault, recovery}`` means exactly the steps named as their kinds, in
that order (a zero duration leaves a step out), each fault active in the step its ``phase``
names. Each fault step is judged against the baseline step before it and the recovery step
after it (``judged_pairs``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from streamquake.units import (
    MAX_USERS,
    SHORTEST_S,
    DurationS,
    PlainName,
    RequestRate,
    ScenarioModel,
    not_shorter_than,
)

StepKind = Literal["warmup", "baseline", "fault", "recovery"]
STEP_KINDS: tuple[StepKind, ...] = ("warmup", "baseline", "fault", "recovery")




class Ramp(ScenarioModel):
    """A rate that changes linearly over the step: ``{from: 5, to: 20}`` (requests/s)."""

    start: RequestRate = Field(alias="from", ge=0)
    end: RequestRate = Field(alias="to", ge=0)


class Spike(ScenarioModel):
    """Within the step, the rate is ``rate`` from ``at`` for ``for``: ``{rate: 80, at: 10s,
    for: 5s}``."""

    rate: RequestRate = Field(gt=0)
    at_s: DurationS = Field(alias="at", ge=0)
    for_s: DurationS = Field(alias="for", gt=0)


class StepLoad(ScenarioModel):
    """A step's own load: ``users: 40`` (closed loop), or ``rate: 10`` / ``rate: {from: 5,
    to: 20}`` (open loop; requests/s), with an optional ``spike`` (open loop)."""

    users: int | None = Field(default=None, ge=1, le=MAX_USERS)
    rate: Annotated[RequestRate, Field(ge=0)] | Ramp | None = None
    spike: Spike | None = None

    @model_validator(mode="after")
    def _one(self) -> StepLoad:
        if (self.users is None) == (self.rate is None):
            raise ValueError("give either 'users' (a closed loop) or 'rate' (an open loop: "
                             "requests/s, or {from: A, to: B} to ramp over the step)")
        if self.spike is not None and self.rate is None:
            raise ValueError("a 'spike' raises an open loop's rate: give a 'rate' too")
        return self

    def rate_at(self, t: float, duration_s: float) -> float | None:
        """The open-loop rate ``t`` seconds into the step (None: a closed loop)."""
        if self.rate is None:
            return None
        if self.spike is not None and self.spike.at_s <= t < self.spike.at_s + self.spike.for_s:
            return self.spike.rate
        if isinstance(self.rate, Ramp):
            share = min(1.0, max(0.0, t / duration_s)) if duration_s > 0 else 1.0
            return self.rate.start + (self.rate.end - self.rate.start) * share
        return float(self.rate)


class StepSpec(ScenarioModel):
    name: PlainName
    kind: StepKind
    duration_s: Annotated[DurationS, not_shorter_than(SHORTEST_S, "a step")] = Field(
        alias="duration", gt=0)
    faults: tuple[str, ...] = ()
    load: StepLoad | None = None

    @model_validator(mode="after")
    def _shape(self) -> StepSpec:
        if len(set(self.faults)) != len(self.faults):
            raise ValueError("a fault is named twice in this step")
        spike = self.load.spike if self.load is not None else None
        if spike is not None and spike.at_s + spike.for_s > self.duration_s:
            raise ValueError(f"the spike ends {spike.at_s + spike.for_s:g} s into a step of "
                             f"{self.duration_s:g} s: start it earlier or make it shorter")
        return self


def timeline_problems(steps: list[StepSpec], fault_names: list[str]) -> list[str]:
    """What is wrong with a ``steps:`` list as a whole (each step is valid alone), one sentence
    each, naming the step as ``steps.N (name)``."""
    problems = []
    names = [s.name for s in steps]
    for dupe in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"two steps are named '{dupe}': give each step a unique name")
    seen_baseline = False
    for i, step in enumerate(steps):
        where = f"steps.{i} ({step.name})"
        if step.faults and step.kind != "fault":
            problems.append(f"{where}: a {step.kind} step runs no faults: make it 'kind: "
                            "fault', or move its faults to a fault step")
        for f in step.faults:
            if f not in fault_names:
                known = ", ".join(fault_names) or "none"
                problems.append(f"{where}: no fault is named '{f}' (faults: {known})")
        if step.kind == "fault" and not seen_baseline:
            problems.append(f"{where}: a fault step needs a baseline step before it, to be "
                            "judged against: add a 'kind: baseline' step earlier")
        seen_baseline = seen_baseline or step.kind == "baseline"
    if not seen_baseline:
        problems.append("the steps have no baseline step: add one ('kind: baseline')")
    listed = {f for s in steps for f in s.faults}
    for f in fault_names:
        if f not in listed:
            problems.append(f"fault '{f}' is in no step: name it in a fault step's 'faults', "
                            "or remove it")
    return problems


def step_load_problems(steps: list[StepSpec], loop: Literal["closed", "open", "trace"]
                       ) -> list[str]:
    """Step loads the scenario's load cannot follow, one sentence each: a closed loop
    (``load.users``) takes steps' ``users``, an open loop (``load.arrival``) their ``rate``
    (and spikes), and a trace replay sends at its rows' own times, so no step load at all."""
    problems = []
    for i, step in enumerate(steps):
        where = f"steps.{i} ({step.name}).load"
        if step.load is None:
            continue
        if loop == "trace":
            problems.append(f"{where}: a trace replay sends each row at its own time: remove "
                            "the step's load, or replay no trace")
        elif loop == "open" and step.load.users is not None:
            problems.append(f"{where}: the load is an open loop (load.arrival): give the step "
                            "a 'rate' (requests/s, or {from: A, to: B}), not 'users'")
        elif loop == "closed" and step.load.rate is not None:
            problems.append(f"{where}: a 'rate' needs an open loop: give the scenario "
                            "'load.arrival' (its rate is the steps' default), or give the "
                            "step 'users'")
    return problems


def judged_pairs(steps: tuple[StepSpec, ...] | list[StepSpec]
                 ) -> list[tuple[StepSpec | None, StepSpec, StepSpec | None]]:
    """Each fault step with the baseline step before it and the recovery step after it (the
    nearest of each kind; None where there is none)."""
    out = []
    for i, step in enumerate(steps):
        if step.kind != "fault":
            continue
        before = next((s for s in reversed(steps[:i]) if s.kind == "baseline"), None)
        after = next((s for s in steps[i + 1:] if s.kind == "recovery"), None)
        out.append((before, step, after))
    return out
