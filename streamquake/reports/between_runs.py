"""Is a change bigger than the variation between runs? The one judgement of ``streamquake
history`` and of ``streamquake compare`` with several runs a side.

Each run gives one figure per phase and metric (its report's: a p95, an error rate). The runs
of A (the earlier ones) are the reference, the runs of B (the latest one, or several) the
candidate; B regressed on a metric when the median of B lies beyond the median of A, in the bad
direction, by more than the margin:

    margin = max(K x spread x sqrt(1/n_a + 1/n_b),       the variation between runs
                 K x sqrt(p (1 - p) (1/N_a + 1/N_b)),    a rate's own sampling (rates only)
                 tolerance x |median of A|,              the smallest change that matters
                 floor)                                  the smallest change one can see

* ``spread``: the runs' own scatter, the standard deviation of each side's runs about that
  side's mean, pooled over the sides with two runs or more (a two-sample t statistic's). With
  one run on the new side the margin is a prediction interval for that run; with several, for
  their median. Not a robust scale: the variation a busy machine brings *is* the runs that went
  far off (a competing load slows the embedded target and the load generator alike), and a
  median absolute deviation, which looks past them, called identical runs worse whenever the
  latest was the busy one (benchmarks/README.md, the A/A study). The centres are medians, so
  one far-off run widens the margin without moving the baseline.
* a rate's sampling: what the counts alone allow (p pooled over both sides, one failure added
  so that none seen is not certainty); where the runs see no errors at all the spread is 0, and
  this is what keeps one error in 40 requests from being a regression.
* ``floor``: 1 ms, or the scenario's ``recovery.slack`` where larger; 0.5 points for rates; 1
  token/s.
* K = 3: for normal figures and 10 earlier runs, about 1 identical run in 130 lies beyond it on
  one metric (Student's t, 9 degrees of freedom), 1 in 50 with 5; the tolerance and the floors
  take most of the rest.

A run whose phase the saturation guard marked (``client_saturated``: the load generator could
not keep up, its timings are distorted) gives no timing figure for that phase (latencies,
tokens/s, the stall rate): it is left out of its side, and said so; its error rate and chunk
loss still count. A percentile from fewer values than bound it on both sides at 95% (72 for a
p95: the run's own rule for its SLO checks) is its top few requests, not a figure of the run:
left out alike. A side left with no run is not judged,
and A with fewer than ``min_runs`` runs is not enough history to know the spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

from streamquake.loadgen.quantile_ci import rank_bounds
from streamquake.metric_catalog import CATALOG, HIGHER_IS_BETTER, METRICS

K = 3.0
SATURATED = "the load generator was saturated"      # how a distorted run's reason begins
CONFIDENCE = 0.95               # of the bounds a run's percentile needs (values_needed)
FLOOR_MS, FLOOR_RATE, FLOOR_TOKENS_PER_S = 1.0, 0.005, 1.0
# The rates compare and history judge between runs (metric_catalog ``compared``).
RATES = frozenset(m.name for m in CATALOG if m.kind == "rate" and m.compared)


def is_timing(metric: str) -> bool:
    """A figure the load generator's own lateness distorts: a latency, tokens/s, and the stall
    rate (a stall is a gap between events longer than a limit); not errors, not lost chunks
    (metric_catalog ``timing``; a name it lacks, by its unit)."""
    return METRICS[metric].timing if metric in METRICS else metric.endswith("_ms")


@dataclass(frozen=True)
class RunFigure:
    """One run's figure of one metric in one phase."""

    run: str                        # how the output names the run (its id, its path)
    value: float | None
    trials: int | None = None       # a rate's requests (its denominator, near enough)
    # Why it does not count (None: it does): its timings are distorted ("the load generator
    # was saturated in baseline of run 7 ..."), or too few values to bound its percentile.
    excluded: str | None = None


@cache
def values_needed(pct: float, confidence: float = CONFIDENCE) -> int:
    """The fewest values whose order statistics bound the ``pct``-th percentile on both sides
    at ``confidence`` (72 for a p95 at 95%): with fewer, the percentile is its top few values."""
    n = 1
    while None in rank_bounds(n, pct / 100.0, confidence):
        n = n + 1 if n < 64 else n * 2
    if n > 64:                      # the first power of two that does: the least, by halving
        lo, hi = n // 2, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if None not in rank_bounds(mid, pct / 100.0, confidence) \
                else (mid, hi)
        n = hi
    return n


def excluded(metric: str, pct: float | None, count: int | None, saturated: str | None,
             where: str) -> str | None:
    """Why a run's figure does not count in a judgement between runs: a timing the load
    generator's saturation distorted (``saturated``: why), or a percentile from fewer values
    than bound it (``count``; ``where``: "baseline of run 7")."""
    if saturated is not None and is_timing(metric):
        return saturated
    if pct is not None and count is not None and count < (need := values_needed(pct)):
        return f"{where} had fewer than the {need} values that bound a p{pct:g}"
    return None


@dataclass
class Between:
    """B against A on one metric of one phase, by the variation between runs."""

    metric: str
    a: float | None                 # the median of A's figures
    b: float | None                 # the median of B's
    n_a: int                        # runs behind each (those left out not counted)
    n_b: int
    spread: float | None            # one run's standard deviation (None: unknown)
    margin: float
    verdict: str                    # worse | better | same | no data | not judged
    floor: float = 0.0
    left_out: list[str] = field(default_factory=list)   # runs whose figures did not count: why
    why: str = ""                   # why not judged

    @property
    def diff(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a


def floor_for(metric: str, slack_ms: float = 0.0) -> float:
    """The smallest change that counts: a latency must also move by more than 1 ms and the
    scenario's own ``recovery.slack``."""
    if metric.endswith("_ms"):
        return max(FLOOR_MS, slack_ms)
    if metric == "output_tokens_per_s":
        return FLOOR_TOKENS_PER_S
    return FLOOR_RATE


def spread(*sides: Sequence[float]) -> float | None:
    """The standard deviation of each side's values about its own mean, pooled over the sides
    with two values or more; None when none has."""
    squares = sum((v - statistics.fmean(side)) ** 2 for side in sides if len(side) >= 2
                  for v in side)
    freedom = sum(len(side) - 1 for side in sides if len(side) >= 2)
    return math.sqrt(squares / freedom) if freedom else None


def _sampling(a: Sequence[RunFigure], b: Sequence[RunFigure]) -> float:
    """K standard errors of the difference of two rates from their counts alone."""
    n_a = sum(f.trials or 0 for f in a)
    n_b = sum(f.trials or 0 for f in b)
    if not n_a or not n_b:
        return 0.0
    hits = sum((f.value or 0.0) * (f.trials or 0) for f in (*a, *b))
    p = (hits + 1.0) / (n_a + n_b + 2.0)
    return K * math.sqrt(p * (1.0 - p) * (1.0 / n_a + 1.0 / n_b))


def judge(metric: str, a: Sequence[RunFigure], b: Sequence[RunFigure], *, tolerance: float,
          slack_ms: float = 0.0, min_runs: int = 1, k: float = K,
          too_few_runs: str = "not enough runs of A",
          sides: tuple[str, str] = ("run of A", "run of B")) -> Between:
    """B against A on ``metric``; see the module's docstring. Where a side has no figure that
    counts, what its runs read is still shown (never judged), against the margin A gives."""
    use_a = [f for f in a if f.value is not None and f.excluded is None]
    use_b = [f for f in b if f.value is not None and f.excluded is None]
    va = [f.value for f in use_a if f.value is not None]
    vb = [f.value for f in use_b if f.value is not None]
    floor = floor_for(metric, slack_ms)
    out = Between(metric, statistics.median(va) if va else None,
                  statistics.median(vb) if vb else None, len(va), len(vb), spread(va, vb),
                  floor, "same", floor,
                  [f.excluded for f in (*a, *b) if f.excluded and f.value is not None])
    if out.a is not None:
        terms = [tolerance * abs(out.a), floor]
        if out.spread is not None:
            terms.append(k * out.spread * math.sqrt(1.0 / len(va) + 1.0 / max(1, len(vb))))
        if metric in RATES:
            terms.append(_sampling(use_a, use_b))
        out.margin = max(terms)
    if out.a is None or out.b is None:
        # A side with no figure: its runs' figures did not count, or none measured it.
        gone = [f for f in (b if out.b is None else a)
                if f.excluded is not None and f.value is not None]
        reasons = list(dict.fromkeys(f.excluded for f in gone if f.excluded))
        out.verdict = "not judged" if gone else "no data"
        out.why = reasons[0] if len(reasons) == 1 else \
            f"no {sides[1] if out.b is None else sides[0]} counts: {'; '.join(reasons)}"
        for side, figures in (("a", a), ("b", b)):     # what was read, shown, never judged
            seen = [f.value for f in figures if f.value is not None]
            if getattr(out, side) is None and seen:
                setattr(out, side, statistics.median(seen))
        return out
    if len(va) < min_runs:
        out.verdict = "not judged"
        out.why = f"{too_few_runs} ({len(va)} of {min_runs})"
        return out
    bad = (out.b - out.a) * (-1.0 if metric in HIGHER_IS_BETTER else 1.0)
    out.verdict = "worse" if bad > out.margin else "better" if bad < -out.margin else "same"
    return out


class Notes:
    """What the output says of the runs that did not count, grouped so that a run of short
    phases gives a line a phase, not one a metric: a phase whose timings were distorted, the
    metrics not judged for the same kind of reason, the runs left out of a percentile."""

    def __init__(self) -> None:
        self._lines: dict[tuple[str, str], list[str]] = {}     # (phase, what) -> metrics

    def add(self, phase: str, metric: str, pct: float | None, got: Between) -> None:
        name = metric if pct is None else f"{metric} p{pct:g}"
        if got.verdict == "not judged":
            if got.why.startswith(SATURATED):
                self._lines.setdefault((phase, f"{phase} timings not judged: {got.why}"), [])
            else:
                self._lines.setdefault((phase, f"not judged: {got.why}"), []).append(name)
            return
        for why in got.left_out:
            if why.startswith(SATURATED):
                self._lines.setdefault((phase, f"left out of the {phase} timings: {why}"), [])
        few = [why for why in got.left_out if not why.startswith(SATURATED)]
        if few and pct is not None:
            self._lines.setdefault((phase, f"{len(few)} run(s) left out, with fewer than the "
                                    f"{values_needed(pct)} values that bound a p{pct:g}"),
                                   []).append(name)

    def lines(self) -> list[str]:
        return [f"{phase} {', '.join(names)} {what}" if names else what
                for (phase, what), names in self._lines.items()]
