"""The run as it happens: rolling statistics over the last seconds (for the live view and
``Tick`` events) and the scenario's abort conditions, fed from the samples the load process
appends (``loadgen/tail.py``). Percentiles here are nearest-rank over the window's values,
with the count behind each; the verdicts still come from the full HDR histograms."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.tail import SampleTail
from streamquake.metric_catalog import names
from streamquake.run.timeline import TICK_S
from streamquake.scenario.schema import AbortCondition
from streamquake.stats import percentile

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


class Watch:
    def __init__(self, samples_dir: Path, conditions: list[AbortCondition]) -> None:
        self.tail = SampleTail(samples_dir)
        self.conditions = conditions
        keep = max([LIVE_WINDOW_S, *(c.for_s for c in conditions)])
        self._keep_s = keep
        self._recent: deque[RequestSample] = deque()
        self._first_sent: float | None = None

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for s in sorted(self.tail.poll(), key=_ended):
            self._recent.append(s)
            self._first_sent = s.sent if self._first_sent is None else min(self._first_sent,
                                                                            s.sent)
        while self._recent and _ended(self._recent[0]) < now - self._keep_s:
            self._recent.popleft()

    def _window(self, now: float, seconds: float) -> list[RequestSample]:
        return [s for s in self._recent if now - seconds <= _ended(s) <= now]

    def rolling(self, now: float | None = None, since: float | None = None) -> RollingStats:
        """The last LIVE_WINDOW_S seconds, but only requests due at ``since`` (the phase's
        start) or later: right after a phase edge, what the last phase did is not this one's."""
        now = time.time() if now is None else now
        window = self._window(now, LIVE_WINDOW_S)
        span = LIVE_WINDOW_S
        if since is not None:
            window = [s for s in window if _due(s) >= since]
            span = max(TICK_S, min(LIVE_WINDOW_S, now - since))
        p50, p95, counts = {}, {}, {}
        for m in LATENCIES:
            values = sorted(_values(window, m))
            p50[m], p95[m], counts[m] = percentile(values, 50), percentile(values, 95), len(values)
        return RollingStats(at=now, window_s=span, requests=len(window),
                            errors=sum(s.error is not None for s in window),
                            per_s=len(window) / span, p50=p50, p95=p95, counts=counts)

    def abort_reason(self, now: float | None = None) -> str | None:
        """The first abort condition that holds now, as a sentence; None if none does."""
        now = time.time() if now is None else now
        for c in self.conditions:
            if self._first_sent is None or now - self._first_sent < c.for_s:
                continue        # the window is not full of this run yet
            window = self._window(now, c.for_s)
            if c.percentile is not None:
                values = sorted(_values(window, c.metric))
                value, n = percentile(values, c.percentile), len(values)
            else:
                value, n = _rate(window, c.metric)
            if value is not None and len(window) >= c.min_requests and value > c.above:
                return (f"abort condition '{c.label}' held: {c.metric}"
                        f"{f' p{c.percentile:g}' if c.percentile else ''} was {value:.4g} over "
                        f"the last {c.for_s:g} s ({n} values from {len(window)} requests)")
        return None
