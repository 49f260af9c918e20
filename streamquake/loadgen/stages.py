"""When a load with stages (a plan's ``stages``) sends: an open loop's arrival times under a
rate that ramps and spikes, and a closed loop's user count at a moment.

An open loop's arrivals come from its cumulative intensity: the integral of the rate. A
constant process is due each time a user's share of that integral reaches the next whole
number (from a random phase, so that users do not fire in lockstep); a Poisson process is a
unit-rate Poisson process rescaled through it (time-rescaling). A rate of 0 sends nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from streamquake.loadgen.plan import LoadStage

# (t0, t1, rate at t0, rate at t1): the rate is linear in between
_Piece = tuple[float, float, float, float]


class RateCurve:
    """An open loop's total rate over time, piecewise linear, from its stages. Before the
    first stage it is the first stage's starting rate; after the last, the last one's end."""

    def __init__(self, stages: Sequence[LoadStage]) -> None:
        first, last = stages[0], stages[-1]
        pieces = [(-math.inf, first.start, _from(first), _from(first))]
        for stage in stages:
            pieces += _pieces(stage)
        pieces.append((last.end, math.inf, _to(last), _to(last)))
        self.pieces = [p for p in pieces if p[1] > p[0]]

    def rate_at(self, t: float) -> float:
        t0, t1, r0, r1 = next(p for p in self.pieces if t < p[1])
        return r0 if math.isinf(t0) or math.isinf(t1) else r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    def advance(self, t: float, mass: float) -> float:
        """The time from ``t`` at which the rate's integral has grown by ``mass`` (inf: never,
        the rate stays at 0)."""
        for t0, t1, r0, r1 in self.pieces:
            if t >= t1:
                continue
            if math.isinf(t1):
                return t + mass / r0 if r0 > 0 else (t if mass <= 0 else math.inf)
            slope = (r1 - r0) / (t1 - t0) if not math.isinf(t0) else 0.0
            a = r0 if math.isinf(t0) else r0 + slope * (t - t0)
            here = (a + r1) / 2 * (t1 - t)
            if mass > here:
                mass -= here
                t = t1
                continue
            # a x + slope x^2 / 2 = mass, in the form that stays exact when slope is ~0
            root = math.sqrt(max(0.0, a * a + 2 * slope * mass))
            return t + (2 * mass / (a + root) if a + root > 0 else 0.0)
        return math.inf


def _from(stage: LoadStage) -> float:
    return stage.rate_from or 0.0


def _to(stage: LoadStage) -> float:
    return stage.rate_to if stage.rate_to is not None else _from(stage)


def _pieces(stage: LoadStage) -> list[_Piece]:
    def ramp(t: float) -> float:
        share = (t - stage.start) / (stage.end - stage.start)
        return _from(stage) + (_to(stage) - _from(stage)) * share

    if stage.spike is None:
        return [(stage.start, stage.end, _from(stage), _to(stage))]
    s0, s1, rate = stage.spike
    return [(stage.start, s0, _from(stage), ramp(s0)), (s0, s1, rate, rate),
            (s1, stage.end, ramp(s1), _to(stage))]


def arrival_times(start: float, rng: random.Random, poisson: bool, rate_per_s: float,
                  users: int, stages: Sequence[LoadStage]) -> Iterator[float]:
    """One open-loop user's arrival times from ``start``, in order, without end (inf once
    the rate stays at 0): its share (1/users) of ``rate_per_s``, or of the stages' rate."""
    if not stages:
        rate = rate_per_s / users
        due = start + (rng.expovariate(rate) if poisson else rng.uniform(0.0, 1.0 / rate))
        while True:
            yield due
            due += rng.expovariate(rate) if poisson else 1.0 / rate
    curve = RateCurve(stages)
    due = curve.advance(start, users * (rng.expovariate(1.0) if poisson else rng.uniform(0, 1)))
    while True:
        yield due
        due = curve.advance(due, users * (rng.expovariate(1.0) if poisson else 1.0))


def users_at(stages: Sequence[LoadStage], t: float, default: int) -> int:
    """A closed loop's user count at ``t``: the latest stage begun that gives one."""
    users = default
    for stage in stages:
        if stage.start > t:
            break
        users = stage.users if stage.users is not None else users
    return users
