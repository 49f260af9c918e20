"""The run as it happens: rolling statistics over the last seconds (for the live view and
``Tick`` events) and the scenario's abort conditions, fed from the samples the load process
appends (``loadgen/tail.py``). Percentiles here are nearest-rank over the window's values,
with the count behind each; the verdicts still come from the full HDR histograms."""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.tail import SampleTail
from streamquake.metric_catalog import names
from streamquake.run.timeline import TICK_S
from streamquake.scenario.schema import AbortCondition
from streamquake.stats import nearest_rank

LIVE_WINDOW_S = 10.0
LATENCIES = names(live=True)     # the live view's rolling p50/p95, from the metric catalog


def _ended(s: RequestSample) -> float:
    return s.sent + (s.e2e_ms or 0.0) / 1000.0


def _due(s: RequestSample) -> float:
    """When it was due (open loop) or sent: the phase it belongs to, as the scorecard says."""
    return s.scheduled if s.scheduled is not None else s.sent


def _values(samples: list[RequestSample], metric: str) -> list[float]:
    if metric == "itl_ms":
        return [g for s in samples for g in s.itl_ms]
    if metric == "e2e_ms":
        return [s.e2e_ms for s in samples
                if s.error is None and not s.cancelled and s.e2e_ms is not None]
    if metric == "output_tokens_per_s":
        return [tps for s in samples if (tps := s.tokens_per_s) is not None]
    return [v for s in samples if (v := getattr(s, metric, None)) is not None]


def _rate(samples: list[RequestSample], metric: str) -> tuple[float | None, int]:
    # A stream the client abandoned (a class's ``cancel``) is neither a success nor an error.
    samples = [s for s in samples if not s.cancelled]
    if metric == "error_rate":
        n = len(samples)
        return (sum(s.error is not None for s in samples) / n if n else None), n
    ok = [s for s in samples if s.error is None]
    if metric == "stall_rate":
        return (sum(s.stalls > 0 for s in ok) / len(ok) if ok else None), len(ok)
    if metric == "chunk_loss":
        expected = sum(s.expected_events for s in samples)
        return ((sum(s.missing_events for s in samples) / expected if expected else None),
                len(samples))
    # A rate the catalog lets an abort condition name must be read here.
    raise KeyError(f"no live rate for {metric!r}")


@dataclass(frozen=True)
class RollingStats:
    """The last ``window_s`` seconds: requests that ended in it."""

    at: float
    window_s: float
    requests: int
    errors: int
    per_s: float
    p50: dict[str, float | None] = field(default_factory=dict)
    p95: dict[str, float | None] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    in_flight: int | None = None   # sent and not ended now (the load processes' own count)


class _Batch:
    """The samples one poll brought, in the order they ended, with each metric's values
    sorted once, on first use, for every window that holds the whole batch."""

    __slots__ = ("samples", "ends", "first_due", "_sorted")

    def __init__(self, samples: list[RequestSample]) -> None:
        self.samples = samples
        self.ends = [_ended(s) for s in samples]
        self.first_due = min(_due(s) for s in samples)
        self._sorted: dict[str, list[float]] = {}

    def sorted_values(self, metric: str) -> list[float]:
        got = self._sorted.get(metric)
        if got is None:
            got = self._sorted[metric] = sorted(_values(self.samples, metric))
        return got


def _kth(runs: list[list[float]], k: int) -> float:
    """The ``k``-th smallest (1-based) of the values in ``runs``, each sorted: what
    ``sorted(all of them)[k - 1]`` is, by bisecting the runs around a pivot (the middle of the
    largest part still in question) instead of sorting them together."""
    lo = [0] * len(runs)
    hi = [len(r) for r in runs]
    while True:
        j = max(range(len(runs)), key=lambda i: hi[i] - lo[i])
        pivot = runs[j][(lo[j] + hi[j]) // 2]
        below = [bisect_left(r, pivot, lo[i], hi[i]) for i, r in enumerate(runs)]
        upto = [bisect_right(r, pivot, lo[i], hi[i]) for i, r in enumerate(runs)]
        n_below = sum(b - a for a, b in zip(lo, below, strict=True))
        n_upto = sum(b - a for a, b in zip(lo, upto, strict=True))
        if k <= n_below:
            hi = below
        elif k <= n_upto:
            return pivot
        else:
            k -= n_upto
            lo = upto


def _ranked(runs: list[list[float]], p: float) -> float | None:
    n = sum(len(r) for r in runs)
    return _kth(runs, nearest_rank(p, n)) if n else None


class Watch:
    """The samples of the last ``keep`` seconds, as the polls brought them. A window's
    percentiles are exact nearest ranks over its values, found in each poll's values sorted
    once (``_Batch``), not by sorting the whole window again on every tick: at 500 streams,
    the last 10 s of inter-token gaps are 200,000 values, whose sort took 47 ms of the runner
    every half second, on a core it may share with a load process."""

    def __init__(self, samples_dir: Path, conditions: list[AbortCondition]) -> None:
        self.tail = SampleTail(samples_dir)
        self.conditions = conditions
        keep = max([LIVE_WINDOW_S, *(c.for_s for c in conditions)])
        self._keep_s = keep
        self._batches: deque[_Batch] = deque()
        self._first_sent: float | None = None

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        new = sorted(self.tail.poll(), key=_ended)
        if new:
            self._batches.append(_Batch(new))
            first = min(s.sent for s in new)
            self._first_sent = first if self._first_sent is None else min(self._first_sent,
                                                                          first)
        while self._batches and self._batches[0].ends[-1] < now - self._keep_s:
            self._batches.popleft()

    def _parts(self, now: float, seconds: float, since: float | None
               ) -> list[tuple[_Batch, list[RequestSample] | None]]:
        """Per batch with samples in the window (ended from ``now - seconds`` to ``now``, due
        at ``since`` or later): None where the window holds it whole, else the samples it
        holds."""
        start = now - seconds
        parts: list[tuple[_Batch, list[RequestSample] | None]] = []
        for b in self._batches:
            if b.ends[-1] < start or b.ends[0] > now:
                continue
            if b.ends[0] >= start and b.ends[-1] <= now and (since is None
                                                             or b.first_due >= since):
                parts.append((b, None))
                continue
            some = b.samples[bisect_left(b.ends, start):bisect_right(b.ends, now)]
            if since is not None:
                some = [s for s in some if _due(s) >= since]
            if some:
                parts.append((b, some))
        return parts

    @staticmethod
    def _samples(parts: list[tuple[_Batch, list[RequestSample] | None]]
                 ) -> list[RequestSample]:
        return [s for b, some in parts for s in (b.samples if some is None else some)]

    @staticmethod
    def _runs(parts: list[tuple[_Batch, list[RequestSample] | None]], metric: str
              ) -> list[list[float]]:
        runs = [b.sorted_values(metric) if some is None else sorted(_values(some, metric))
                for b, some in parts]
        return [r for r in runs if r]

    def rolling(self, now: float | None = None, since: float | None = None) -> RollingStats:
        """The last LIVE_WINDOW_S seconds, but only requests due at ``since`` (the phase's
        start) or later: right after a phase edge, what the last phase did is not this one's."""
        now = time.time() if now is None else now
        parts = self._parts(now, LIVE_WINDOW_S, since)
        window = self._samples(parts)
        span = LIVE_WINDOW_S
        if since is not None:
            span = max(TICK_S, min(LIVE_WINDOW_S, now - since))
        p50, p95, counts = {}, {}, {}
        for m in LATENCIES:
            runs = self._runs(parts, m)
            p50[m], p95[m], counts[m] = _ranked(runs, 50), _ranked(runs, 95), sum(map(len, runs))
        return RollingStats(at=now, window_s=span, requests=len(window),
                            errors=sum(s.error is not None for s in window),
                            per_s=len(window) / span, p50=p50, p95=p95, counts=counts)

    def abort_reason(self, now: float | None = None) -> str | None:
        """The first abort condition that holds now, as a sentence; None if none does."""
        now = time.time() if now is None else now
        for c in self.conditions:
            if self._first_sent is None or now - self._first_sent < c.for_s:
                continue        # the window is not full of this run yet
            parts = self._parts(now, c.for_s, None)
            window = self._samples(parts)
            if c.percentile is not None:
                runs = self._runs(parts, c.metric)
                value, n = _ranked(runs, c.percentile), sum(map(len, runs))
            else:
                value, n = _rate(window, c.metric)
            if value is not None and len(window) >= c.min_requests and value > c.above:
                return (f"abort condition '{c.label}' held: {c.metric}"
                        f"{f' p{c.percentile:g}' if c.percentile else ''} was {value:.4g} over "
                        f"the last {c.for_s:g} s ({n} values from {len(window)} requests)")
        return None
