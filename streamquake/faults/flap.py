"""Flapping: a fault switched on and off inside its window, the way intermittent networks and
flaky GPUs behave. The envelope's ``flap`` field (``envelope.py``) holds a :class:`Flap`; the
runner asks it for the on-intervals of one window and applies and reverts the fault at each edge.

``on``/``off`` are each a fixed duration (``2s``) or a random one (``{mean: 2s}``, optionally
``min``/``max``): drawn from ``distribution`` (exponential, or uniform over [0, 2 * mean]) by
an RNG seeded with ``seed`` (or the scenario's ``load.seed``) and the fault's name, then clamped
to [min, max], so one scenario flaps alike on every run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from streamquake.units import DURATION, ScenarioModel, parse_duration_s

# The shortest state: the runner times edges with its sleep (run/timeline.py), to within a few
# ms on a quiet host; a fault that cannot stay on this long is better given a probability.
MIN_STATE_S = 0.1


def _duration_s(v: object) -> float:
    s = parse_duration_s(v)
    if s < MIN_STATE_S:
        raise ValueError(f"must be at least {MIN_STATE_S:g}s (the runner cannot time edges "
                         f"closer than that), got {v!r}")
    return s


StateS = Annotated[float, DURATION, BeforeValidator(_duration_s)]




class Draw(ScenarioModel):
    """A random state length: its mean, clamped to [min, max]."""

    mean_s: StateS = Field(alias="mean")
    min_s: StateS = Field(default=MIN_STATE_S, alias="min")
    max_s: StateS | None = Field(default=None, alias="max")

    @model_validator(mode="after")
    def _ordered(self) -> Draw:
        if self.max_s is not None and self.max_s < self.min_s:
            raise ValueError(f"max ({self.max_s:g}s) is below min ({self.min_s:g}s)")
        if not self.min_s <= self.mean_s <= (self.max_s or self.mean_s):
            raise ValueError(f"mean ({self.mean_s:g}s) must lie between min and max")
        return self

    def draw(self, rng: random.Random, distribution: str) -> float:
        x = (rng.expovariate(1.0 / self.mean_s) if distribution == "exponential"
             else rng.uniform(0.0, 2.0 * self.mean_s))
        return min(max(x, self.min_s), math.inf if self.max_s is None else self.max_s)


class Flap(ScenarioModel):
    on: Annotated[float | Draw, DURATION]   # the Unit tells the reference; _length converts
    off: Annotated[float | Draw, DURATION]
    start: Literal["on", "off"] = "on"
    distribution: Literal["exponential", "uniform"] = "exponential"
    seed: int | None = None

    @field_validator("on", "off", mode="before")
    @classmethod
    def _length(cls, v: object) -> object:
        return v if isinstance(v, dict | Draw) else _duration_s(v)

    @model_validator(mode="after")
    def _random_only(self) -> Flap:
        if self.fixed and self.model_fields_set & {"distribution", "seed"}:
            raise ValueError("'distribution' and 'seed' apply to random states "
                             "({mean: 2s}); 'on' and 'off' are both fixed here")
        return self

    @property
    def fixed(self) -> bool:
        return not isinstance(self.on, Draw) and not isinstance(self.off, Draw)

    def shortest_s(self, state: str) -> float:
        length = self.on if state == "on" else self.off
        return length.min_s if isinstance(length, Draw) else length

    def typical_s(self, state: str) -> float:
        length = self.on if state == "on" else self.off
        return length.mean_s if isinstance(length, Draw) else length

    def on_intervals(self, length_s: float, seed: int, label: str) -> list[tuple[float, float]]:
        """The on-intervals in a window of ``length_s``, as (start, end) offsets from its start.
        The RNG is seeded by the seed and the fault's name (a str seed hashes alike anywhere)."""
        return list(self.iter_on_intervals(length_s, seed, label))

    def iter_on_intervals(self, length_s: float, seed: int,
                          label: str) -> Iterator[tuple[float, float]]:
        """``on_intervals`` one at a time, drawn as they are asked for: a run takes the next
        only when the last has ended, so a long window (a 10^9 s step flapping every 100 ms)
        costs no more memory than a short one (issue 37)."""
        rng = random.Random(f"{self.seed if self.seed is not None else seed}:{label}")
        t, on = 0.0, self.start == "on"
        while length_s - t >= MIN_STATE_S:
            length = self.on if on else self.off
            d = length.draw(rng, self.distribution) if isinstance(length, Draw) else length
            if on:
                yield t, min(t + d, length_s)
            t, on = t + d, not on
