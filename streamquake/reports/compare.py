"""``streamquake compare A B``: per phase and metric, B - A with a confidence interval, and a
verdict better / same / worse beyond a tolerance.

Method: a percentile bootstrap over requests. Each resample draws every phase's requests with
replacement, independently in A and in B, and recomputes each metric exactly from the raw
per-request samples (nearest-rank percentiles; a request's ITL gaps travel with it, so their
correlation within a stream is kept). What of a request counts in a phase is the run's rule
(reports/saved_run.py), so A and B are the figures their reports show. The interval is the
(1-c)/2 and (1+c)/2 quantiles of the resampled differences. A verdict is **worse** (or
**better**) only when the *whole* interval lies beyond the tolerance margin, max(tolerance x A,
an absolute floor: 1 ms or B's scenario's ``recovery.slack`` if larger, 0.5 points, 1 token/s),
in the bad (good) direction: it takes a difference that is both real and material, and it
keeps dozens of metrics x phases from raising false alarms by chance. Otherwise **same**, marked
unsure when the interval reaches past the margin (not enough data to rule a change out).
Without samples (a report.json copied on its own) the point difference is judged against the
margin with no interval, and the output says so. ``streamquake history`` judges a latest run
against the runs before it by this same test (history.py).

Runs of ``steps:`` scenarios are compared step by step, matched by name (every step but the
warmup ones, in A's order, then B's own); a step that only one side ran is said so, not compared.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamquake.jsontypes import JsonDict
from streamquake.reports.phrasing import value_text
from streamquake.reports.saved_run import LoadedPhase, LoadedRun, Share
from streamquake.run.series import values_of
from streamquake.stats import nearest_rank

PHASES = ("baseline", "fault", "recovery")
# (metric, percentile or None for a rate); lower is better except tokens/s.
METRICS: tuple[tuple[str, float | None], ...] = (
    ("ttfb_ms", 50), ("ttfb_ms", 95), ("ttft_ms", 50), ("ttft_ms", 95), ("itl_ms", 50),
    ("itl_ms", 95), ("e2e_ms", 50), ("e2e_ms", 95), ("output_tokens_per_s", 50),
    ("error_rate", None), ("stall_rate", None), ("chunk_loss", None),
)
HIGHER_IS_BETTER = frozenset({"output_tokens_per_s"})
FLOORS = {"ms": 1.0, "rate": 0.005, "output_tokens_per_s": 1.0}   # absolute margins


def metric_name(metric: str, pct: float | None) -> str:
    return metric if pct is None else f"{metric} p{pct:g}"


def floor_for(metric: str, slack_ms: float = 0.0) -> float:
    """The smallest change that counts: a latency must also move by more than the scenario's
    own ``recovery.slack``."""
    if metric.endswith("_ms"):
        return max(FLOORS["ms"], slack_ms)
    if metric == "output_tokens_per_s":
        return FLOORS[metric]
    return FLOORS["rate"]


@dataclass
class Row:
    phase: str
    metric: str
    pct: float | None
    a: float | None
    b: float | None
    n_a: int
    n_b: int
    diff: float | None
    lo: float | None
    hi: float | None
    margin: float
    verdict: str                    # better | same | worse | no data
    sure: bool                      # False: the interval reaches past the margin

    @property
    def name(self) -> str:
        return metric_name(self.metric, self.pct)

    def to_json(self) -> JsonDict:
        return {"phase": self.phase, "metric": self.metric, "percentile": self.pct,
                "a": self.a, "b": self.b, "n_a": self.n_a, "n_b": self.n_b, "diff": self.diff,
                "ci_low": self.lo, "ci_high": self.hi, "margin": self.margin,
                "verdict": self.verdict, "sure": self.sure}


@dataclass
class Comparison:
    a: LoadedRun
    b: LoadedRun
    rows: list[Row]
    tolerance: float
    confidence: float
    resamples: int
    method: str
    slack_ms: float = 0.0
    differs: str | None = None          # A and B ran different scenarios (different_scenarios)
    phases: tuple[str, ...] = PHASES    # what was compared, in order (steps: by name)
    one_side: list[tuple[str, str]] = field(default_factory=list)   # (A | B, step): only there

    def one_side_text(self) -> list[str]:
        return [f"step {step} is in {side} only ({'B' if side == 'A' else 'A'} has no step of "
                "that name): not compared" for side, step in self.one_side]

    @property
    def worse(self) -> list[Row]:
        return [r for r in self.rows if r.verdict == "worse"]


# --- per-request data, prepared once per phase ----------------------------------------------

@dataclass
class _Prepared:
    """One phase's requests, arranged so a resample's metric is a weighted rank lookup."""

    n: int
    ended: int                                 # requests whose end counts here
    sorted_values: dict[str, list[float]]      # metric -> values, ascending
    owners: dict[str, list[int]]               # metric -> request index of each value
    rates: dict[str, tuple[list[float], list[float]]]   # metric -> (numerator, denominator)


def _values(share: Share, metric: str) -> list[float]:
    if metric == "itl_ms":
        return share.gaps
    counted = {"ttfb_ms": share.first_byte, "ttft_ms": share.first_token}.get(metric,
                                                                            share.ended)
    return values_of(share.sample, metric) if counted else []


def _prepare(shares: Sequence[Share]) -> _Prepared:
    prep = _Prepared(n=len(shares), ended=0, sorted_values={}, owners={}, rates={})
    for metric in {m for m, p in METRICS if p is not None}:
        pairs = sorted((v, i) for i, s in enumerate(shares) for v in _values(s, metric))
        prep.sorted_values[metric] = [v for v, _ in pairs]
        prep.owners[metric] = [i for _, i in pairs]
    ok = [s.ended and s.sample.error is None for s in shares]
    prep.rates["error_rate"] = ([float(s.ended and s.sample.error is not None) for s in shares],
                                [float(s.ended) for s in shares])
    prep.rates["stall_rate"] = ([float(x and s.sample.stalls > 0) for x, s in zip(ok, shares,
                                                                                  strict=True)],
                                [float(x) for x in ok])
    prep.rates["chunk_loss"] = ([float(s.sample.missing_events * s.ended) for s in shares],
                                [float(s.sample.expected_events * s.ended) for s in shares])
    prep.ended = sum(s.ended for s in shares)
    return prep


def _metric(prep: _Prepared, weights: Sequence[int], metric: str,
            pct: float | None) -> float | None:
    """``metric`` over the requests weighted by ``weights`` (a resample's multiplicities)."""
    if pct is None:
        num, den = prep.rates[metric]
        total = sum(w * d for w, d in zip(weights, den, strict=True))
        return sum(w * x for w, x in zip(weights, num, strict=True)) / total if total else None
    values, owners = prep.sorted_values[metric], prep.owners[metric]
    cum = list(itertools.accumulate(weights[i] for i in owners))
    if not cum or cum[-1] == 0:
        return None
    rank = nearest_rank(pct, cum[-1])
    return values[bisect.bisect_left(cum, rank)]


def _resample(rng: random.Random, n: int) -> list[int]:
    weights = [0] * n
    for i in rng.choices(range(n), k=n):
        weights[i] += 1
    return weights


# --- the comparison ----------------------------------------------------------------------------

def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, math.floor(q * len(sorted_values))))]


def judge(metric: str, a: float | None, diff: float | None, lo: float | None,
          hi: float | None, tolerance: float, slack_ms: float = 0.0) -> tuple[float, str, bool]:
    """(margin, verdict, sure) for B - A = ``diff`` with the interval [lo, hi] (None: a point
    estimate only)."""
    floor = floor_for(metric, slack_ms)
    margin = max(tolerance * abs(a), floor) if a is not None else floor
    if diff is None:
        return margin, "no data", False
    sign = -1.0 if metric in HIGHER_IS_BETTER else 1.0        # > 0: B is worse
    if lo is None or hi is None:                              # no samples: point estimate only
        bad = sign * diff
        verdict = "worse" if bad > margin else "better" if bad < -margin else "same"
        return margin, verdict, False
    bad_lo, bad_hi = sorted((sign * lo, sign * hi))
    if bad_lo > margin:
        return margin, "worse", True
    if bad_hi < -margin:
        return margin, "better", True
    return margin, "same", -margin <= bad_lo and bad_hi <= margin


def _point(phase: LoadedPhase, metric: str, pct: float | None) -> float | None:
    value = phase.stats.get(metric)
    if pct is None:
        return float(value) if isinstance(value, int | float) else None
    if isinstance(value, dict):
        got = value.get(f"p{pct:g}")
        return float(got) if isinstance(got, int | float) else None
    return None


def different_scenarios(a: LoadedRun, b: LoadedRun) -> str | None:
    """Why A and B are not two runs of one scenario definition (None when they are)."""
    if a.scenario_name != b.scenario_name:
        return (f"A ran scenario {a.scenario_name!r} and B ran {b.scenario_name!r}: different "
                "scenarios")
    if a.scenario_sha256 and b.scenario_sha256 and a.scenario_sha256 != b.scenario_sha256:
        return (f"A and B ran different definitions of scenario {a.scenario_name!r} (sha256 "
                f"{a.scenario_sha256} and {b.scenario_sha256})")
    return None


def _matched(a: LoadedRun, b: LoadedRun) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    """The phases to compare and the steps only one side has: baseline, fault, recovery for
    two phases runs; else every step but the warmup ones, by name."""
    if not (a.steps_form or b.steps_form):
        return PHASES, []

    def measured(run: LoadedRun) -> list[str]:
        return [n for n, p in run.phases.items() if p.kind != "warmup"]
    in_a, in_b = measured(a), measured(b)
    both = tuple(n for n in dict.fromkeys([*in_a, *in_b]) if n in in_a and n in in_b)
    return both, [("A", n) for n in in_a if n not in in_b] + [("B", n) for n in in_b
                                                              if n not in in_a]


def compare(a: LoadedRun, b: LoadedRun, *, tolerance: float = 0.10, confidence: float = 0.95,
            resamples: int = 1000, seed: int = 1,
            progress: Callable[[str], None] | None = None) -> Comparison:
    """B against A per phase and metric; the floor for latencies is B's scenario's slack."""
    rng = random.Random(seed)
    with_ci = a.has_samples and b.has_samples and resamples > 0
    method = (f"percentile bootstrap over requests ({resamples} resamples, seed {seed}); "
              f"{confidence * 100:g}% intervals" if with_ci else
              "point estimates from report.json only (per-request samples not found): "
              "no confidence interval")
    rows: list[Row] = []
    phases, one_side = _matched(a, b)
    for phase in phases:
        pa, pb = a.phases.get(phase), b.phases.get(phase)
        if pa is None or pb is None or "not run" in (pa.status, pb.status):
            continue
        if progress is not None:
            progress(f"comparing {phase}")
        rows += _compare_phase(phase, pa, pb, with_ci, rng, tolerance, confidence, resamples,
                               b.slack_ms)
    return Comparison(a, b, rows, tolerance, confidence, resamples if with_ci else 0, method,
                      b.slack_ms, different_scenarios(a, b), phases, one_side)


def _compare_phase(phase: str, pa: LoadedPhase, pb: LoadedPhase, with_ci: bool,
                   rng: random.Random, tolerance: float, confidence: float,
                   resamples: int, slack_ms: float) -> list[Row]:
    prep_a, prep_b = _prepare(pa.samples), _prepare(pb.samples)
    diffs: dict[tuple[str, float | None], list[float]] = {m: [] for m in METRICS}
    if with_ci and prep_a.n and prep_b.n:
        for _ in range(resamples):
            wa, wb = _resample(rng, prep_a.n), _resample(rng, prep_b.n)
            for metric, pct in METRICS:
                va, vb = _metric(prep_a, wa, metric, pct), _metric(prep_b, wb, metric, pct)
                if va is not None and vb is not None:
                    diffs[(metric, pct)].append(vb - va)
    rows = []
    ones_a, ones_b = [1] * prep_a.n, [1] * prep_b.n
    for metric, pct in METRICS:
        if with_ci:
            va, vb = _metric(prep_a, ones_a, metric, pct), _metric(prep_b, ones_b, metric, pct)
        else:
            va, vb = _point(pa, metric, pct), _point(pb, metric, pct)
        diff = vb - va if va is not None and vb is not None else None
        lo = hi = None
        got = sorted(diffs[(metric, pct)])
        # An interval only when (nearly) every resample had data on both sides.
        if with_ci and got and len(got) >= 0.9 * resamples:
            lo, hi = _quantile(got, (1 - confidence) / 2), _quantile(got, (1 + confidence) / 2)
        margin, verdict, sure = judge(metric, va, diff, lo, hi, tolerance, slack_ms)
        if with_ci and diff is not None and lo is None:
            verdict, sure = "same", False      # too little data for an interval: no claim
        n_a = len(prep_a.sorted_values.get(metric, [])) if pct is not None else prep_a.ended
        n_b = len(prep_b.sorted_values.get(metric, [])) if pct is not None else prep_b.ended
        rows.append(Row(phase, metric, pct, va, vb, n_a, n_b, diff, lo, hi, margin, verdict,
                        sure))
    return rows


# --- output ------------------------------------------------------------------------------------

def _v(metric: str, value: float | None) -> str:
    return value_text(metric, value) if value is not None else "-"


def _signed(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    text = _v(metric, abs(value))
    return ("+" if value >= 0 else "-") + text


def verdict_text(row: Row) -> str:
    if row.verdict == "same" and not row.sure:
        return "same (unsure)"
    return row.verdict


def markdown(c: Comparison) -> str:
    head = "worse" if c.worse else "no regression"
    lines = [
        f"## streamquake compare: {head}", "",
        f"- **A**: `{c.a.path}` ({c.a.scenario_name}, sha256 `{c.a.scenario_sha256 or '-'}`)",
        f"- **B**: `{c.b.path}` ({c.b.scenario_name}, sha256 `{c.b.scenario_sha256 or '-'}`)",
        f"- Δ = B − A. Method: {c.method}. A verdict is worse/better only when the whole "
        f"interval lies beyond ±max({c.tolerance * 100:g}% of A, floor: "
        f"{floor_for('e2e_ms', c.slack_ms):g} ms, 0.5 points, 1 token/s); *same (unsure)*: "
        "the interval reaches past that margin.",
    ]
    if c.differs is not None:
        lines.append(f"- **Note**: {c.differs}; compared as asked (--different-scenarios).")
    lines += [f"- **Note**: {text}." for text in c.one_side_text()]
    for phase in c.phases:
        rows = [r for r in c.rows if r.phase == phase]
        if not rows:
            continue
        lines += ["", f"### {phase}", "",
                  f"| metric | A | B | Δ | {c.confidence * 100:g}% CI | n A / B | verdict |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            ci = "-" if r.lo is None else f"{_signed(r.metric, r.lo)} … {_signed(r.metric, r.hi)}"
            verdict = f"**{r.verdict} ❌**" if r.verdict == "worse" else verdict_text(r)
            lines.append(f"| {r.name} | {_v(r.metric, r.a)} | {_v(r.metric, r.b)} | "
                         f"{_signed(r.metric, r.diff)} | {ci} | {r.n_a} / {r.n_b} | {verdict} |")
    return "\n".join(lines) + "\n"


def to_json(c: Comparison) -> JsonDict:
    return {"a": str(c.a.path), "b": str(c.b.path), "method": c.method,
            "tolerance": c.tolerance, "confidence": c.confidence, "slack_ms": c.slack_ms,
            "different_scenarios": c.differs,
            "regression": bool(c.worse), "rows": [r.to_json() for r in c.rows],
            **({"steps": list(c.phases), "one_side": [{"run": side, "step": step}
                                                      for side, step in c.one_side]}
               if c.a.steps_form or c.b.steps_form else {})}
