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
from streamquake.metric_catalog import CATALOG, HIGHER_IS_BETTER, stat_percentile
from streamquake.reports.between_runs import (
    SATURATED,
    K,
    Notes,
    RunFigure,
    excluded,
    floor_for,
    is_timing,
)
from streamquake.reports.between_runs import judge as judge_between
from streamquake.reports.phrasing import value_text
from streamquake.reports.saved_run import LoadedPhase, LoadedRun, Share
from streamquake.run.series import values_of
from streamquake.stats import nearest_rank

PHASES = ("baseline", "fault", "recovery")
# (metric, percentile or None for a rate): what the catalog says compare judges, in its order.
METRICS: tuple[tuple[str, float | None], ...] = tuple(
    (m.name, stat_percentile(stat)) for m in CATALOG for stat in m.compared)
MIN_RUNS = 3        # runs of A that judge by the variation between runs (``--min-runs``)


def metric_name(metric: str, pct: float | None) -> str:
    return metric if pct is None else f"{metric} p{pct:g}"


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
    verdict: str                    # better | same | worse | no data | not judged
    sure: bool                      # False: the interval reaches past the margin
    spread: float | None = None     # between runs: one run's standard deviation (robust)
    why: str = ""                   # why not judged

    @property
    def name(self) -> str:
        return metric_name(self.metric, self.pct)

    def to_json(self) -> JsonDict:
        return {"phase": self.phase, "metric": self.metric, "percentile": self.pct,
                "a": self.a, "b": self.b, "n_a": self.n_a, "n_b": self.n_b, "diff": self.diff,
                "ci_low": self.lo, "ci_high": self.hi, "margin": self.margin,
                "spread": self.spread, "verdict": self.verdict, "sure": self.sure,
                "why": self.why or None}


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
    a_runs: list[LoadedRun] = field(default_factory=list)   # every run of each side
    b_runs: list[LoadedRun] = field(default_factory=list)
    between: bool = False               # judged by the variation between runs (several runs)
    # Why the verdicts do not gate (too few runs of A to know the variation between runs).
    not_judged: str | None = None
    notes: list[str] = field(default_factory=list)   # phases not judged, runs left out: why

    def one_side_text(self) -> list[str]:
        return [f"step {step} is in {side} only ({'B' if side == 'A' else 'A'} has no step of "
                "that name): not compared" for side, step in self.one_side]

    @property
    def worse(self) -> list[Row]:
        """The regressions; none where the comparison was not judged."""
        return [] if self.not_judged else [r for r in self.rows if r.verdict == "worse"]


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


def distorted(run: LoadedRun, phase: str) -> str | None:
    """Why ``run``'s timings in ``phase`` are distorted: its saturation guard marked the load
    generator saturated there (None: it did not)."""
    p = run.phases.get(phase)
    if p is None or p.stats.get("client_saturated") is not True:
        return None
    client = p.stats.get("client")
    seconds = ""
    if isinstance(client, dict) and isinstance(client.get("saturated_s"), int) \
            and isinstance(client.get("seconds"), int):
        seconds = f" ({client['saturated_s']} of {client['seconds']} s saturated)"
    return f"{SATURATED} in {phase} of run {run.path.parent}{seconds}"


def compare(a: LoadedRun, b: LoadedRun, *, tolerance: float = 0.10, confidence: float = 0.95,
            resamples: int = 1000, seed: int = 1,
            progress: Callable[[str], None] | None = None) -> Comparison:
    """B against A per phase and metric, one run a side, by the requests within the two runs;
    the floor for latencies is B's scenario's slack. A phase either run's guard marked
    saturated is not judged on its timings."""
    rng = random.Random(seed)
    with_ci = a.has_samples and b.has_samples and resamples > 0
    method = (f"percentile bootstrap over requests ({resamples} resamples, seed {seed}); "
              f"{confidence * 100:g}% intervals" if with_ci else
              "point estimates from report.json only (per-request samples not found): "
              "no confidence interval")
    rows: list[Row] = []
    notes: list[str] = []
    phases, one_side = _matched(a, b)
    for phase in phases:
        pa, pb = a.phases.get(phase), b.phases.get(phase)
        if pa is None or pb is None or "not run" in (pa.status, pb.status):
            continue
        if progress is not None:
            progress(f"comparing {phase}")
        got = _compare_phase(phase, pa, pb, with_ci, rng, tolerance, confidence, resamples,
                             b.slack_ms)
        why = distorted(a, phase) or distorted(b, phase)
        if why is not None:
            notes.append(f"{phase} timings not judged: {why}")
            for r in got:
                if is_timing(r.metric):
                    r.verdict, r.sure, r.why = "not judged", False, why
        rows += got
    return Comparison(a, b, rows, tolerance, confidence, resamples if with_ci else 0, method,
                      b.slack_ms, different_scenarios(a, b), phases, one_side, [a], [b],
                      notes=notes)


def compare_runs(a_runs: Sequence[LoadedRun], b_runs: Sequence[LoadedRun], *,
                 tolerance: float = 0.10, confidence: float = 0.95, resamples: int = 1000,
                 seed: int = 1, min_runs: int = MIN_RUNS,
                 progress: Callable[[str], None] | None = None) -> Comparison:
    """The runs of B against the runs of A. One run a side: the requests within them (see
    :func:`compare`), judged only with ``min_runs`` 1; else by the variation between runs
    (reports/between_runs.py), A needing ``min_runs`` runs."""
    a, b = a_runs[0], b_runs[0]
    if len(a_runs) == 1 and len(b_runs) == 1:
        c = compare(a, b, tolerance=tolerance, confidence=confidence, resamples=resamples,
                    seed=seed, progress=progress)
        if min_runs > 1:
            c.not_judged = (f"not enough runs (1 of {min_runs} runs of A): one run a side "
                            "cannot tell a change from the variation between runs")
            c.notes.insert(0, "the verdicts shown are the within-run test's, for information; "
                           f"give {min_runs} or more runs of A (compare A1 A2 A3 -- B) to "
                           "judge, or --min-runs 1 to gate on these")
        return c
    phases, one_side = _matched(a, b)
    rows: list[Row] = []
    said = Notes()
    for phase in phases:
        if not all(any(_ran(r, phase) for r in side) for side in (a_runs, b_runs)):
            continue
        if progress is not None:
            progress(f"comparing {phase}")
        rows += _between_phase(phase, a_runs, b_runs, tolerance, min_runs, said)
    differs = next((why for run in [*a_runs[1:], *b_runs] if (why := different_scenarios(
        a, run)) is not None), None)
    method = (f"the variation between runs: the median of {len(a_runs)} run(s) of A against "
              f"the median of {len(b_runs)} run(s) of B")
    return Comparison(a, b, rows, tolerance, confidence, 0, method, b.slack_ms, differs,
                      phases, one_side, list(a_runs), list(b_runs), between=True,
                      notes=said.lines())


def _ran(run: LoadedRun, phase: str) -> bool:
    p = run.phases.get(phase)
    return p is not None and p.status != "not run"


def _count(phase: LoadedPhase, metric: str) -> int | None:
    """The values behind a percentile of ``metric``: measured, and censored where counted."""
    summary = phase.stats.get(metric)
    count = summary.get("count") if isinstance(summary, dict) else None
    if not isinstance(summary, dict) or not isinstance(count, int):
        return None
    censored = summary.get("censored")
    return count + (censored if isinstance(censored, int) else 0)


def _figure(run: LoadedRun, phase: str, metric: str, pct: float | None) -> RunFigure:
    p = run.phases.get(phase)
    label = str(run.path.parent)
    if p is None or p.status == "not run":
        return RunFigure(label, None)
    requests = p.stats.get("requests")
    return RunFigure(label, _point(p, metric, pct),
                     requests if isinstance(requests, int) else None,
                     excluded(metric, pct, _count(p, metric), distorted(run, phase),
                              f"{phase} of run {label}"))


def _between_phase(phase: str, a_runs: Sequence[LoadedRun], b_runs: Sequence[LoadedRun],
                   tolerance: float, min_runs: int, said: Notes) -> list[Row]:
    rows = []
    slack = b_runs[0].slack_ms
    for metric, pct in METRICS:
        got = judge_between(metric, [_figure(r, phase, metric, pct) for r in a_runs],
                            [_figure(r, phase, metric, pct) for r in b_runs],
                            tolerance=tolerance, slack_ms=slack, min_runs=min_runs)
        said.add(phase, metric, pct, got)
        rows.append(Row(phase, metric, pct, got.a, got.b, got.n_a, got.n_b, got.diff, None,
                        None, got.margin, got.verdict, got.verdict != "not judged",
                        got.spread, got.why))
    return rows


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


def headline(c: Comparison) -> str:
    """What the comparison concludes, in one line."""
    if c.not_judged is not None:
        return f"not judged: {c.not_judged}"
    if c.worse:
        return (f"REGRESSION: {len(c.worse)} metric(s) worse: "
                + ", ".join(f"{r.phase} {r.name}" for r in c.worse))
    return "no regression"


def rule_text(c: Comparison) -> str:
    """How a verdict is reached, in one sentence."""
    floor = floor_for("e2e_ms", c.slack_ms)
    if c.between:
        return (f"B - A; {c.method}: worse/better only beyond the margin max({K:g} x spread x "
                f"sqrt(1/runs of A + 1/runs of B), {c.tolerance * 100:g}% of A, floor: "
                f"{floor:g} ms, 0.5 points, 1 token/s); spread: one run's standard deviation, "
                "from the runs of each side")
    return (f"B - A; {c.method}; worse/better only when the whole interval lies beyond the "
            f"margin max({c.tolerance * 100:g}% of A, floor: {floor:g} ms, 0.5 points, 1 "
            "token/s)")


def columns(c: Comparison) -> tuple[str, ...]:
    if c.between:
        return ("metric", "A", "B", "B - A", "margin", "spread", "runs A / B", "verdict")
    return ("metric", "A", "B", "B - A", f"{c.confidence * 100:g}% CI", "n A / B", "verdict")


def cells(c: Comparison, r: Row) -> tuple[str, ...]:
    """A row's cells but its verdict, in the order of :func:`columns`."""
    if c.between:
        return (r.name, _v(r.metric, r.a), _v(r.metric, r.b), _signed(r.metric, r.diff),
                _v(r.metric, r.margin), _v(r.metric, r.spread), f"{r.n_a} / {r.n_b}")
    ci = "-" if r.lo is None else f"{_signed(r.metric, r.lo)} .. {_signed(r.metric, r.hi)}"
    return (r.name, _v(r.metric, r.a), _v(r.metric, r.b), _signed(r.metric, r.diff), ci,
            f"{r.n_a} / {r.n_b}")


def _paths(runs: Sequence[LoadedRun]) -> str:
    return ", ".join(f"`{r.path}`" for r in runs)


def markdown(c: Comparison) -> str:
    head = "worse" if c.worse else "not judged" if c.not_judged else "no regression"
    a, b = c.a_runs or [c.a], c.b_runs or [c.b]
    lines = [
        f"## streamquake compare: {head}", "",
        f"- **A** ({len(a)} run(s)): {_paths(a)} ({c.a.scenario_name}, sha256 "
        f"`{c.a.scenario_sha256 or '-'}`)",
        f"- **B** ({len(b)} run(s)): {_paths(b)} ({c.b.scenario_name}, sha256 "
        f"`{c.b.scenario_sha256 or '-'}`)",
        f"- Δ = {rule_text(c).replace('B - A; ', 'B − A. Method: ', 1)}"
        + ("" if c.between else "; *same (unsure)*: the interval reaches past that margin") + ".",
    ]
    if c.not_judged is not None:
        lines.append(f"- **Not judged**: {c.not_judged}.")
    if c.differs is not None:
        lines.append(f"- **Note**: {c.differs}; compared as asked (--different-scenarios).")
    lines += [f"- **Note**: {text}." for text in [*c.one_side_text(), *c.notes]]
    for phase in c.phases:
        rows = [r for r in c.rows if r.phase == phase]
        if not rows:
            continue
        heads = columns(c)
        lines += ["", f"### {phase}", "", "| " + " | ".join(heads) + " |",
                  "|---|" + "---:|" * (len(heads) - 2) + "---|"]
        for r in rows:
            verdict = f"**{r.verdict} ❌**" if r.verdict == "worse" else verdict_text(r)
            shown = [x.replace(" .. ", " … ") for x in cells(c, r)]
            lines.append("| " + " | ".join([*shown, verdict]) + " |")
    return "\n".join(lines) + "\n"


def to_json(c: Comparison) -> JsonDict:
    return {"a": str(c.a.path), "b": str(c.b.path),
            "a_runs": [str(r.path) for r in c.a_runs or [c.a]],
            "b_runs": [str(r.path) for r in c.b_runs or [c.b]],
            "method": c.method, "between_runs": c.between,
            "tolerance": c.tolerance, "confidence": c.confidence, "slack_ms": c.slack_ms,
            "different_scenarios": c.differs, "not_judged": c.not_judged,
            "notes": list(c.notes),
            "regression": bool(c.worse), "rows": [r.to_json() for r in c.rows],
            **({"steps": list(c.phases), "one_side": [{"run": side, "step": step}
                                                      for side, step in c.one_side]}
               if c.a.steps_form or c.b.steps_form else {})}
