"""Time to recovery: after a fault step's faults are reverted, when did the service come back?

Measured from the per-request samples after the run (so it needs ``load.samples: all``), once
per judged fault (each fault step and the recovery step after it), by this module's own rule for
where each value counts (not the phases' rule in loadgen/scorecard.py):

* **Windows that hold enough requests.** Window starts step by a tenth of ``recovery.window``
  (2 s unless set) from the revert. A window holds the requests due (open loop) or sent (closed
  loop) from its start for ``recovery.window``, and, where that is too few, on until it holds
  :func:`window_requests` of them with a value of each recovery metric: the fewest for which the
  percentile (``recovery.percentile``) has a distribution-free confidence interval on both sides
  at ``verdicts.confidence`` (72 for p95 at 95%: loadgen/quantile_ci.py). Every measurement of a
  request counts in its window whenever it ends, even after the step. A window the step's last
  requests cannot fill is *short*: it can show the service not back, never back.
* **Each request counts once.** Per metric, a request is *beyond* the limit that the baseline
  step's percentile sets (tolerance and slack, as the recovery check judges it: run/verdicts.py)
  by the share of its values beyond it (one value for TTFT; the share of its gaps for ITL), and
  a request that failed without a value of the metric is beyond it (the service is not back
  while requests fail). So a window of m requests holds ``b`` beyond, and its percentile is
  within the limit at nearest rank r when b <= m - r; *back* with the interval when b <= m - u
  (u: the upper rank bound of rank_bounds, the interval's top within the limit); *not back*
  when b > m - l (its bottom beyond the limit); else undecided. (For a metric where more is
  better, mirrored.) One request moves b by at most 1: with 72 requests a p95 is the 69th, so
  one slow request leaves the window within the limit, and "not back" takes 8.
* **Requests that depend on each other count as fewer.** One stall of a busy machine (or of the
  service) slows every request in flight at once: several slow requests, one event. So for the
  interval (back, not back, not the time itself) a window's m requests count as m / d
  independent ones, b / d of them beyond, where d is the recovery step's design effect for the
  metric's percentile: its requests over what the spread of its time batches says they are
  worth (loadgen/quantile_ci.py; the recovery check's "worth N independent"). A service still
  slow at the step's end is slow through the last window, all of it beyond the limit, and
  that stays a conclusion; a 0.7 s stall among 170 requests (worth 16) is not.
* **Streams still open from the fault step count.** A request due in the fault step whose
  measurement ends after the revert kept its user waiting into the recovery step. Per metric,
  each counts once, in the windows whose span holds the end of its last measurement after the
  revert (the end of the stream, for ITL; its first token, for TTFT), with only the wait after
  the revert (a TTFT of 5 s whose first token came 3 s after the revert counts 3 s), and beyond
  the limit by the same rule; one that failed after the revert is beyond it at its end. So a
  service whose new requests are fast while the fault's streams still hang is not back until
  enough of those have ended, or ended within the limit; one hanging stream alone decides
  nothing, like one slow request.

The answer, from the windows in order: ``time_s``, the start of the first window from which
every later window with enough requests has its percentile within the limit and none is "not
back" (None when no window has enough requests, or the last ones are over); ``earliest_s``, the
start after the last window that is "not back" (the time the evidence allows at the earliest);
``latest_s``, the start of the first window from which every later one is "back" (None: the
requests after it are too few, or too slow, to show that). When the step's last window is "not
back", the service did not come back within the step: ``not_recovered``, a conclusion. When
neither can be said (too few requests, or the last windows' percentile over the limit by too
few of them to be sure), the time is unknown, with the reason. An SLO on ``recovery_time_s``
(run/verdicts.py) is met when ``latest_s`` meets it, broken when ``earliest_s`` breaks it or
the service did not come back, and inconclusive otherwise.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from streamquake.loadgen.attribution import WindowLike, due_at
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.quantile_ci import min_samples_for_upper_bound, rank_bounds
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.tail import RunSamples
from streamquake.result import FaultRecord, RecoveryTime
from streamquake.run.verdicts import recovery_limit
from streamquake.scenario import HIGHER_IS_BETTER, RecoverySpec, Scenario
from streamquake.stats import nearest_rank

STEPS_PER_WINDOW = 10    # window starts per window length: the time resolution
_EPS = 1e-9              # shares are sums of fractions: compare counts with this slack


def window_requests(percentile: float, confidence: float) -> int:
    """The fewest requests whose ``percentile`` (0-100, below 100) has a distribution-free
    interval on both sides at ``confidence``: 72 for p95 at 95%, 6 for p50."""
    p = percentile / 100.0
    return max(min_samples_for_upper_bound(p, confidence),
               min_samples_for_upper_bound(1.0 - p, confidence))


@functools.lru_cache(maxsize=4096)
def _bounds(m: int, p: float, confidence: float) -> tuple[int | None, int | None]:
    return rank_bounds(m, p, confidence)


# -- each request's values ---------------------------------------------------------------------

def _values(s: RequestSample, metric: str) -> list[float]:
    """The values ``s`` gives ``metric``, as a phase counts them (loadgen/metrics.py)."""
    ok = s.error is None and not s.cancelled    # an abandoned stream has no E2E of its own
    one: float | None
    if metric == "itl_ms":
        return list(s.itl_ms)
    if metric == "output_tokens_per_s":
        one = s.tokens_per_s
    elif metric in ("e2e_ms", "e2e_scheduled_ms"):
        one = getattr(s, metric) if ok else None
    else:
        one = getattr(s, metric)
    return [] if one is None else [one]


def _end(s: RequestSample, metric: str, value: float) -> float:
    """Epoch s the measurement of ``metric`` (of ``value`` ms) ended."""
    if metric in ("ttfb_ms", "ttft_ms", "ttfa_ms", "e2e_ms"):
        return s.sent + value / 1000.0
    if metric in ("ttft_scheduled_ms", "e2e_scheduled_ms"):
        return due_at(s) + value / 1000.0
    if metric == "queue_delay_ms":
        return s.started
    return s.sent            # send_ms and its parts end when the request is written


def _gap_ends(s: RequestSample) -> list[tuple[float, float]]:
    """(end epoch s, gap ms) of each inter-token gap, from the first token on."""
    if s.ttft_ms is None:
        return []
    t, out = s.sent + s.ttft_ms / 1000.0, []
    for gap in s.itl_ms:
        t += gap / 1000.0
        out.append((t, gap))
    return out


def _after(s: RequestSample, metric: str, since: float) -> tuple[list[float], float] | None:
    """What of ``metric`` a request due before ``since`` (the revert) measured after it: the
    waits after ``since`` (each value cut to its part after it) and when the last ended."""
    if metric in ("itl_ms", "output_tokens_per_s"):
        gaps = [(end, min(gap, (end - since) * 1000.0)) for end, gap in _gap_ends(s)
                if end > since]
        if not gaps:
            return None
        if metric == "itl_ms":
            return [g for _, g in gaps], gaps[-1][0]
        if s.error is not None or (held := sum(g for _, g in gaps)) <= 0:
            return None
        return [len(gaps) / (held / 1000.0)], gaps[-1][0]
    values = _values(s, metric)
    if not values:
        return None
    end = _end(s, metric, values[0])
    if end <= since:
        return None
    return [min(values[0], (end - since) * 1000.0)], end


def _beyond(values: Sequence[float], limit: float, higher_is_better: bool) -> float:
    """The share of ``values`` on the wrong side of ``limit``."""
    out = sum(1 for v in values if (v < limit if higher_is_better else v > limit))
    return out / len(values)


@dataclass
class _Counts:
    """One metric's requests in time order, as running totals: how many count, how many beyond
    (shares), so that any run of them is two subtractions."""

    times: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=lambda: [0])
    beyond: list[float] = field(default_factory=lambda: [0.0])

    def add(self, at: float, share: float | None) -> None:
        self.times.append(at)
        self.count.append(self.count[-1] + (share is not None))
        self.beyond.append(self.beyond[-1] + (share or 0.0))

    def between(self, lo: int, hi: int) -> tuple[int, float]:
        return self.count[hi] - self.count[lo], self.beyond[hi] - self.beyond[lo]


@dataclass
class _Window:
    start: float
    end: float
    requests: int
    short: bool               # too few requests for both sides of the interval
    within: bool              # every metric's percentile within its limit (nearest rank)
    back: bool                # ... with the interval
    not_back: bool            # some metric's percentile beyond its limit with the interval
    beyond: float             # of the metric that decided the window: requests beyond,
    of: int                   #   of how many


def _judge(m: int, b: float, p: float, confidence: float, higher: bool, deff: float = 1.0
           ) -> tuple[bool, bool, bool, bool]:
    """(short, within, back, not back) for ``m`` requests of which ``b`` are beyond; for the
    interval they are worth ``m / deff`` independent ones, as many beyond in proportion."""
    if m == 0:
        return True, False, False, False
    low, up = _bounds(m, p / 100.0, confidence)
    short = low is None or up is None
    rank = nearest_rank(p, m)
    within = b <= rank - 1 + _EPS if higher else b <= m - rank + _EPS
    worth = math.floor(m / deff + _EPS)
    if worth < 1:
        return short, within, False, False
    if worth < m:
        low, up = _bounds(worth, p / 100.0, confidence)
        b = b * worth / m
    if higher:          # the percentile must stay at or above: the low side is the bad one
        return (short, within, low is not None and b <= low - 1 + _EPS,
                up is not None and b >= up - _EPS)
    return (short, within, up is not None and b <= worth - up + _EPS,
            low is not None and b > worth - low + _EPS)


def time_to_recovery(samples: Sequence[RequestSample], step: str, after: WindowLike,
                     reverted_at: float, before: Mapping[str, float | None],
                     spec: RecoverySpec, confidence: float = 0.95,
                     since: float | None = None,
                     dependence: Mapping[str, float] | None = None) -> RecoveryTime:
    """The time to recovery in the recovery step ``after`` of the fault step ``step`` whose
    faults were reverted at ``reverted_at`` (epoch s); ``before``: each recovery metric's
    percentile in the baseline step (None: not measured there); ``since``: when the fault step
    began (its requests still open after the revert count; None: any request due before);
    ``dependence``: each metric's design effect in the recovery step (:func:`design_effect`;
    1, independent requests, where not given)."""
    start = max(reverted_at, after.start)
    resolution = spec.window_s / STEPS_PER_WINDOW
    limits: dict[str, float | None] = {m: recovery_limit(spec, m, before.get(m))
                                       for m in spec.metrics}
    out = RecoveryTime(step=step, after=after.name, reverted_at=reverted_at, recovered=False,
                       time_s=None, within_s=round(after.end - reverted_at, 3),
                       window_s=spec.window_s, resolution_s=resolution, requests=None,
                       metrics=list(spec.metrics), percentile=spec.percentile, limits=limits,
                       confidence=confidence,
                       dependence={m: round(max(1.0, (dependence or {}).get(m, 1.0)), 2)
                                   for m in spec.metrics})
    missing = [m for m, limit in limits.items() if limit is None]
    if missing:
        out.detail = f"no {', '.join(missing)} in the baseline step to come back to"
        return out
    if spec.percentile >= 100:
        out.detail = ("recovery.percentile 100 (the maximum) is bounded from above by no number "
                      "of requests, so no window can show the service back: use 99 or below")
        return out
    if start + spec.window_s > after.end:
        out.detail = (f"the recovery step after the revert ({after.end - start:.1f} s) is "
                      f"shorter than recovery.window ({spec.window_s:g} s)")
        return out
    needed = out.needed = window_requests(spec.percentile, confidence)
    kept = [s for s in samples if not s.retried]
    own = sorted((s for s in kept if start <= due_at(s) < after.end), key=due_at)
    due = [due_at(s) for s in own]
    opened = -float("inf") if since is None else since
    carried = [s for s in kept if opened <= due_at(s) < start]
    own_counts: dict[str, _Counts] = {}
    late_counts: dict[str, _Counts] = {}
    still_open: list[float] = []
    last = after.end - 1e-6              # a stream still open at the step's end counts there
    for metric in spec.metrics:
        limit, higher = limits[metric], metric in HIGHER_IS_BETTER
        assert limit is not None
        mine = own_counts[metric] = _Counts()
        for s, at in zip(own, due, strict=True):
            values = _values(s, metric)
            mine.add(at, _beyond(values, limit, higher) if values else
                     1.0 if s.error is not None else None)
        units: list[tuple[float, float]] = []
        for s in carried:
            if (seen := _after(s, metric, start)) is not None:
                units.append((min(seen[1], last), _beyond(seen[0], limit, higher)))
                still_open.append(seen[1])
            elif s.error is not None and not _values(s, metric) and \
                    (end := s.sent + (s.e2e_ms or 0.0) / 1000.0) > start:
                units.append((min(end, last), 1.0))
                still_open.append(end)
        theirs = late_counts[metric] = _Counts()
        for at, share in sorted(units):
            theirs.add(at, share)
    out.carried = len({id(s) for s in carried if _any_after(s, start)})
    out.carried_until_s = round(max(still_open) - reverted_at, 3) if still_open else None

    def window(t: float) -> _Window:
        lo, hi = bisect.bisect_left(due, t), bisect.bisect_left(due, t + spec.window_s)
        end = t + spec.window_s
        for counts in own_counts.values():       # on until each metric has enough requests
            want = counts.count[lo] + needed
            if counts.count[-1] >= want:
                reach = bisect.bisect_left(counts.count, want)   # prefix index: reach requests
                if reach > hi:
                    hi, end = reach, due[reach] if reach < len(due) else after.end
            elif hi < len(due):
                hi, end = len(due), after.end
        w = _Window(t, end, 0, False, True, True, False, 0.0, 0)
        worst = -1.0
        for metric, counts in own_counts.items():
            m, b = counts.between(lo, hi)
            late = late_counts[metric]
            m2, b2 = late.between(bisect.bisect_left(late.times, t),
                                  bisect.bisect_left(late.times, end))
            m, b = m + m2, b + b2
            short, within, back, not_back = _judge(m, b, spec.percentile, confidence,
                                                   metric in HIGHER_IS_BETTER,
                                                   out.dependence[metric])
            w.requests = max(w.requests, m)
            w.short |= short
            w.within &= within
            w.back &= back and not short
            w.not_back |= not_back
            if m and b / m > worst:
                worst, w.beyond, w.of = b / m, b, m
        return w

    starts = [start + k * resolution
              for k in range(int((after.end - spec.window_s - start) / resolution + 1e-9) + 1)]
    windows = [window(t) for t in starts]
    _answer(out, windows, reverted_at, spec, due, needed)
    return out


def _any_after(s: RequestSample, since: float) -> bool:
    return s.sent + (s.e2e_ms or 0.0) / 1000.0 > since


def _answer(out: RecoveryTime, windows: Sequence[_Window], reverted_at: float,
            spec: RecoverySpec, due: Sequence[float], needed: int) -> None:
    """Read the windows in order into ``out`` (see the module docstring)."""
    def at(w: _Window) -> float:
        return round(w.start - reverted_at, 3)

    pct = f"p{spec.percentile:g}"
    last_out = max((k for k, w in enumerate(windows) if w.not_back), default=-1)
    if last_out == len(windows) - 1:
        w = windows[-1]
        out.not_recovered = True
        out.why = (f"the last window's {pct} is over the limit at "
                   f"{out.confidence * 100:g}%: {_count(w.beyond)} of {w.of} requests beyond it")
        return
    earliest = last_out + 1
    out.earliest_s = at(windows[earliest])
    # Each from the first window from which every later one with enough requests is back
    # (latest) or within the limit (the time); the short ones at the step's end decide nothing.
    back = _first_from(windows[earliest:], lambda w: w.back)
    if back is not None:
        out.latest_s = at(windows[earliest + back])
    point = _first_from(windows[earliest:], lambda w: w.within)
    if point is not None:
        w = windows[earliest + point]
        out.recovered, out.time_s, out.requests = True, at(w), w.requests
        out.span_s = round(w.end - w.start, 3)
        return
    rest = windows[earliest:]
    if all(w.short for w in rest):
        after = "the revert" if earliest == 0 else "the last window over the limit"
        left = len(due) - bisect.bisect_left(due, rest[0].start)
        out.why = (f"too few requests: a window needs {needed} for its {pct} to be bounded at "
                   f"{out.confidence * 100:g}%, and {left} were due after {after}")
        return
    w = next(w for w in reversed(rest) if not w.short)
    out.why = (f"the last window's {pct} is over the limit ({_count(w.beyond)} of {w.of} "
               f"requests beyond it), too few to be sure")


def _first_from(windows: Sequence[_Window], good: Callable[[_Window], bool]) -> int | None:
    """The index of the first window from which every later one with enough requests is
    ``good``, when one of them is; None when none is, or the last of them is not."""
    first = None
    for k in range(len(windows) - 1, -1, -1):
        w = windows[k]
        if not w.short:
            if not good(w):
                break
            first = k
        elif first is not None:
            first = k
    return first


def _count(beyond: float) -> str:
    return f"{beyond:.0f}" if abs(beyond - round(beyond)) < 1e-6 else f"{beyond:.1f}"


def design_effect(stats: Stats, metric: str, percentile: float, confidence: float) -> float:
    """How many requests of ``stats`` (a step) count as one independent one for ``metric``'s
    percentile: the requests behind it over n*, what the spread of the step's time batches says
    they are worth (loadgen/quantile_ci.py); at least 1. ITL counts per request, not per gap."""
    worth = stats.effective_count(metric, percentile, confidence)
    units = min(stats.samples(metric), stats.requests)
    return max(1.0, units / worth) if worth > 0 else 1.0


def reverted(records: Sequence[FaultRecord], faults: Sequence[str], since: float,
             until: float) -> float | None:
    """When the last of ``faults`` was reverted between ``since`` and ``until`` (epoch s)."""
    return max((r.reverted_at for r in records if r.name in faults and r.reverted_at is not None
                and since <= r.reverted_at <= until), default=None)


def recovery_times(scenario: Scenario, windows: Sequence[WindowLike],
                   records: Sequence[FaultRecord], stats: Mapping[str, Stats],
                   run_samples: RunSamples | None) -> tuple[list[RecoveryTime], list[str]]:
    """The time to recovery of each judged fault (a fault step with a baseline step before it
    and a recovery step after it), and warnings for what could not be measured
    (``run_samples``: None where the run kept no samples)."""
    spec = scenario.recovery
    if spec is None:
        return [], []
    by_name = {w.name: w for w in windows}
    pairs = [(before.name, step, after.name) for before, step, after in
             scenario.judged if before is not None and after is not None
             and before.name in stats and step.name in by_name and after.name in by_name]
    if not pairs:
        return [], []
    if run_samples is None:
        return [], ["time to recovery needs the per-request samples, and load.samples is "
                    "'none': not measured"]
    samples = run_samples.all()
    out = []
    for before, step, after_name in pairs:
        after, during = by_name[after_name], by_name[step.name]
        at = reverted(records, step.faults, during.start, after.end)
        base: dict[str, float | None] = {m: stats[before].percentile(m, spec.percentile)
                                         for m in spec.metrics}
        conf = scenario.verdicts.confidence
        deff: dict[str, float] | None = {
            m: design_effect(stats[after_name], m, spec.percentile, conf)
            for m in spec.metrics} if after_name in stats else None
        out.append(time_to_recovery(samples, step.name, after,
                                    at if at is not None else after.start, base, spec, conf,
                                    since=during.start, dependence=deff))
    return out, []
