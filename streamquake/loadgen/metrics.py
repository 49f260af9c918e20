"""Per-request measurements folded into full-precision HDR histograms and rates, for SLO
verdicts.

Locust's own statistics round response times into coarse buckets; verdicts come from here.
Times are recorded in microseconds with 4 significant digits: 0.1 ms resolution up to ~1.6 s,
1 ms up to ~16 s. Which samples feed which metric:

* ``ttfb_ms``, ``ttft_ms``, ``itl_ms``: every request that measured them, failed ones too (a
  stream cut after its first token still showed its user that first token).
* ``e2e_ms``, ``output_tokens_per_s``: successful requests only; a failed stream's end time
  says how it failed, not how long a completion takes.
* ``queue_delay_ms``: open-loop requests (attempt start - scheduled), failed or not.
* ``send_ms``: every request whose last byte was written: the attempt's start to that moment
  (a free pooled connection, or a new one's connect, then the write). TTFB, TTFT and E2E are
  timed from the write, so a slow connect or a client late to write shows here, not in them.
* ``ttft_scheduled_ms``, ``e2e_scheduled_ms``: open loop, TTFT and E2E timed from when the
  request was due rather than sent (queue delay + TTFT), so a client that falls behind cannot
  hide the wait (coordinated omission; wrk2's and k6's corrected latency).
* ``not_sent_rate``: open-loop arrivals due but never sent, over all arrivals due.

``add`` takes a whole request; the scoring (``run/scoring.py``) instead adds each measurement
to the phase it belongs to (``add_first_token``, ``add_gaps``, ``add_outcome``...) and counts
the ones no phase can own in ``unattributed``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamquake.loadgen.histogram import SparseHistogram
from streamquake.loadgen.quantile_ci import normal_quantile, rank_bounds
from streamquake.loadgen.samples import ERROR_KINDS, RequestSample

HISTOGRAM_METRICS: tuple[str, ...] = (
    "ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens_per_s", "queue_delay_ms",
    "ttft_scheduled_ms", "e2e_scheduled_ms", "send_ms",
)
RATE_METRICS: tuple[str, ...] = ("error_rate", "stall_rate", "chunk_loss", "not_sent_rate")
# What a measurement is counted as when it cannot be attributed to one phase (run/scoring.py):
# ``e2e_ms`` stands for the request's end, and with it its outcome, stalls and chunks.
UNATTRIBUTED: tuple[str, ...] = ("ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms", "queue_delay_ms")
_FROM_SCHEDULE = frozenset({"queue_delay_ms", "ttft_scheduled_ms", "e2e_scheduled_ms"})
# A histogram metric -> the unattributed count that stands for its measurements.
_SPANNED_AS = {"ttfb_ms": "ttfb_ms", "ttft_ms": "ttft_ms", "ttft_scheduled_ms": "ttft_ms",
               "itl_ms": "itl_ms", "e2e_ms": "e2e_ms", "e2e_scheduled_ms": "e2e_ms",
               "output_tokens_per_s": "e2e_ms", "queue_delay_ms": "queue_delay_ms"}
SUMMARY_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)

_SIG_FIGS = 4
_SCALE = 1000.0                   # ms -> us, and tokens/s -> milli-tokens/s
_REASONS_PER_KIND = 8
_OTHER_REASONS = "(other reasons)"


@dataclass
class Stats:
    """Histograms and counts over one set of samples (a phase, a window, a whole run)."""

    requests: int = 0                 # requests whose end (outcome, E2E) is counted here
    sent: int = 0                     # requests sent for arrivals due here, however they ended
    not_sent: int = 0                 # open-loop arrivals due here and never sent
    unattributed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNATTRIBUTED, 0))
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    # kind -> reason (the sample's error_detail) -> count; a few reasons per kind, the rest
    # pooled, so the report says why (a TLS failure's "self-signed certificate") at bounded size.
    error_reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    successes: int = 0
    stalled: int = 0                  # successful requests with at least one stall
    retries: int = 0                  # extra attempts behind the requests counted here
    retried_attempts: dict[str, int] = field(default_factory=dict)   # by error kind
    missing_events: int = 0
    expected_events: int = 0
    stalls: int = 0                   # server stalls in the requests counted here
    client_stalls: int = 0            # gaps that were the load process's own lateness
    shared_stamps: int = 0            # inter-token gaps of events read with the one before
    # Created on first use (closed loop never fills three of them); sparse, sized by use.
    histograms: dict[str, SparseHistogram] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, samples: Iterable[RequestSample]) -> Stats:
        stats = cls()
        for s in samples:
            stats.add(s)
        return stats

    def add(self, s: RequestSample) -> None:
        """One whole request, every measurement of it counted here."""
        if s.retried:
            self.add_retried(s)
            return
        self.add_sent(s)
        self.add_queue_delay(s)
        self.add_first_byte(s)
        self.add_first_token(s)
        self.add_gaps(s.itl_ms)
        self.add_outcome(s)

    def add_retried(self, s: RequestSample) -> None:
        # A failed attempt that was retried: its request ends in a later attempt, so it is
        # counted apart, never as a request, an error or a latency (retries hide nothing).
        kind = s.error or "unknown"
        self.retried_attempts[kind] = self.retried_attempts.get(kind, 0) + 1

    def add_sent(self, s: RequestSample) -> None:
        self.sent += 1
        self.retries += s.attempt - 1
        if s.send_ms is not None:
            self._put("send_ms", s.send_ms)

    def add_not_sent(self) -> None:
        self.not_sent += 1

    def add_unattributed(self, metric: str, n: int = 1) -> None:
        self.unattributed[metric] = self.unattributed.get(metric, 0) + n

    def add_queue_delay(self, s: RequestSample) -> None:
        if (queue := s.queue_delay_ms) is not None:
            self._put("queue_delay_ms", queue)

    def add_first_byte(self, s: RequestSample) -> None:
        if s.ttfb_ms is not None:
            self._put("ttfb_ms", s.ttfb_ms)

    def add_first_token(self, s: RequestSample) -> None:
        if s.ttft_ms is not None:
            self._put("ttft_ms", s.ttft_ms)
        if (due := s.ttft_scheduled_ms) is not None:
            self._put("ttft_scheduled_ms", due)

    def add_gaps(self, gaps_ms: list[float]) -> None:
        if gaps_ms:
            self._hist_for("itl_ms").record_ms(gaps_ms)
            # A gap of exactly 0: its event shared one stamp (one read) with the one before.
            self.shared_stamps += gaps_ms.count(0.0)

    @property
    def shared_stamp_share(self) -> float | None:
        """Of the inter-token gaps here, the share whose event was read together with the one
        before it: one stamp for both, so the gap reads 0 and the next read's gap holds both."""
        n = self.count("itl_ms")
        return min(1.0, self.shared_stamps / n) if n else None

    def add_outcome(self, s: RequestSample) -> None:
        """The request's end: counted as a request, its error or success, E2E, stalls, chunks."""
        self.requests += 1
        self.missing_events += s.missing_events
        self.expected_events += s.expected_events
        self.stalls += s.stalls
        self.client_stalls += s.client_stalls
        if s.error is not None:
            self.errors[s.error] = self.errors.get(s.error, 0) + 1
            reasons = self.error_reasons.setdefault(s.error, {})
            reason = s.error_detail or "(no reason given)"
            if reason not in reasons and len(reasons) >= _REASONS_PER_KIND:
                reason = _OTHER_REASONS
            reasons[reason] = reasons.get(reason, 0) + 1
            return
        self.successes += 1
        self.stalled += int(s.stalls > 0)
        if s.e2e_ms is not None:
            self._put("e2e_ms", s.e2e_ms)
            if (due := s.e2e_scheduled_ms) is not None:
                self._put("e2e_scheduled_ms", due)
            if s.ttft_ms is not None and s.e2e_ms > s.ttft_ms and s.output_tokens > 0:
                self._put("output_tokens_per_s",
                             s.output_tokens / ((s.e2e_ms - s.ttft_ms) / 1e3))

    def _put(self, metric: str, value: float) -> None:
        self._hist_for(metric).record(round(value * _SCALE))

    def _hist_for(self, metric: str) -> SparseHistogram:
        hist = self.histograms.get(metric)
        if hist is None:
            hist = self.histograms[metric] = SparseHistogram(_SIG_FIGS)
        return hist

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def percentile(self, metric: str, p: float) -> float | None:
        """The ``p``-th percentile of ``metric`` (0 < p <= 100) by nearest rank, ceil(p/100 *
        n): the smallest value with at least p% of the values at or below it, which is what
        "p99 <= 300 ms" promises. None if nothing was recorded."""
        hist = self._hist(metric)
        value = None if hist is None else hist.percentile(p)
        return None if value is None else value / _SCALE

    def count(self, metric: str) -> int:
        hist = self._hist(metric)
        return 0 if hist is None else hist.total

    def mean(self, metric: str) -> float | None:
        hist = self._hist(metric)
        value = None if hist is None else hist.mean()
        return None if value is None else value / _SCALE

    def max(self, metric: str) -> float | None:
        hist = self._hist(metric)
        value = None if hist is None else hist.max()
        return None if value is None else value / _SCALE

    def value(self, metric: str) -> float | None:
        """A rate metric (``error_rate``, ``stall_rate``, ``chunk_loss``); None if undefined."""
        if metric == "error_rate":
            return self.error_count / self.requests if self.requests else None
        if metric == "stall_rate":
            return self.stalled / self.successes if self.successes else None
        if metric == "chunk_loss":
            return self.missing_events / self.expected_events if self.expected_events else None
        if metric == "not_sent_rate":
            due = self.sent + self.not_sent
            return self.not_sent / due if due else None
        raise KeyError(f"unknown rate metric {metric!r}; known: {', '.join(RATE_METRICS)}")

    def percentile_interval(self, metric: str, p: float, confidence: float
                            ) -> tuple[float | None, float | None, int]:
        """(low, high, n): a distribution-free ``confidence`` interval for the ``p``-th
        percentile from order statistics (loadgen/quantile_ci.py); a side no observation can
        bound at that confidence is None."""
        n = self.count(metric)
        low_rank, high_rank = rank_bounds(n, p / 100.0, confidence)

        def at_rank(rank: int | None) -> float | None:
            # HDR finds the value at ceil(q/100 * n); half a rank below lands exactly on it.
            return None if rank is None else self.percentile(metric, 100.0 * (rank - 0.5) / n)

        return at_rank(low_rank), at_rank(high_rank), n

    def rate_interval(self, metric: str, confidence: float
                      ) -> tuple[float | None, float | None, int]:
        """(low, high, n): a Wilson score interval for a rate metric over its n trials."""
        k, n = {"error_rate": (self.error_count, self.requests),
                "stall_rate": (self.stalled, self.successes),
                "chunk_loss": (self.missing_events, self.expected_events),
                "not_sent_rate": (self.not_sent, self.sent + self.not_sent)}[metric]
        if n == 0:
            return None, None, 0
        z = normal_quantile(confidence)
        phat = k / n
        centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, centre - half), min(1.0, centre + half), n

    def unavailable(self, metric: str) -> str | None:
        """Why ``metric`` has no value in these samples (None when it has one)."""
        if metric == "chunk_loss" and self.successes and not self.expected_events:
            return ("not measurable: the server numbers none of its events (no SSE `id:` "
                    "lines), so lost chunks cannot be counted; the embedded target numbers "
                    "them with `sse_event_ids: true`")
        scheduled = self.not_sent or self.count("queue_delay_ms") \
            or self.unattributed.get("queue_delay_ms")
        if metric in _FROM_SCHEDULE and self.sent and not scheduled:
            return ("no data: no request here had a schedule; this metric measures open-loop "
                    "arrivals (load.arrival), not a closed loop (load.think_time)")
        spanned = self.unattributed.get(_SPANNED_AS.get(metric, ""), 0)
        if spanned and not self.count(metric):
            return (f"no data: every measurement of it here ({spanned}) spanned the phase's "
                    "end, so none could be attributed to the phase (see `unattributed`)")
        if not self.requests and self.not_sent:
            return (f"no data: no request ended in this phase, and {self.not_sent} arrivals "
                    "due in it were never sent")
        if not self.requests:
            return "no data: no request was scored in this phase"
        return None

    def summary(self, metric: str) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count(metric), "mean": self.mean(metric)}
        for p in SUMMARY_PERCENTILES:
            out[f"p{p:g}"] = self.percentile(metric, p)
        out["max"] = self.max(metric)
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests,
            "sent": self.sent,
            "not_sent": self.not_sent,
            "unattributed": dict(self.unattributed),
            "successes": self.successes,
            "retried_attempts": dict(self.retried_attempts),
            "requests_retried": self.retries,
            "shared_stamps": self.shared_stamps,
            "shared_stamp_share": self.shared_stamp_share,
            "errors": dict(self.errors),
            "error_reasons": {kind: dict(sorted(r.items(), key=lambda kv: -kv[1]))
                              for kind, r in self.error_reasons.items()},
        }
        out.update({m: self.value(m) for m in RATE_METRICS})
        out.update({m: self.summary(m) for m in HISTOGRAM_METRICS})
        return out

    def _hist(self, metric: str) -> SparseHistogram | None:
        if metric not in HISTOGRAM_METRICS:
            raise KeyError(f"unknown metric {metric!r}; known: {', '.join(HISTOGRAM_METRICS)}")
        return self.histograms.get(metric)

    # -- across processes: merge, and the wire form (loadgen/scorecard.py) ---------------------

    def merge(self, other: Stats) -> None:
        """Add ``other``'s counts and histograms to these: the union's statistics, exactly."""
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for table in _TABLES:
            mine, theirs = getattr(self, table), getattr(other, table)
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        for kind, reasons in other.error_reasons.items():
            mine = self.error_reasons.setdefault(kind, {})
            for reason, n in reasons.items():
                if reason not in mine and len(mine) >= _REASONS_PER_KIND:
                    reason = _OTHER_REASONS
                mine[reason] = mine.get(reason, 0) + n
        for metric, hist in other.histograms.items():
            if metric not in self.histograms:
                self.histograms[metric] = SparseHistogram(_SIG_FIGS)
            self.histograms[metric].merge(hist)

    def to_wire(self) -> dict[str, Any]:
        """Counts as numbers, histograms as standard HdrHistogram V2 histoblobs."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS}
        out.update({table: dict(getattr(self, table)) for table in _TABLES})
        out["error_reasons"] = {k: dict(v) for k, v in self.error_reasons.items()}
        out["histograms"] = {m: h.encode() for m, h in self.histograms.items() if h.total}
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Stats:
        stats = cls()
        for name in _COUNTERS:
            setattr(stats, name, int(data.get(name, 0)))
        for table in _TABLES:
            getattr(stats, table).update({str(k): int(v) for k, v in data.get(table, {}).items()})
        stats.error_reasons = {str(k): {str(r): int(n) for r, n in v.items()}
                               for k, v in data.get("error_reasons", {}).items()}
        for metric, blob in data.get("histograms", {}).items():
            if metric not in HISTOGRAM_METRICS:
                raise ValueError(f"unknown metric {metric!r} in a scorecard")
            stats.histograms[metric] = SparseHistogram.decode(blob, _SIG_FIGS)
        return stats


_COUNTERS = ("requests", "sent", "not_sent", "successes", "stalled", "retries",
             "missing_events", "expected_events", "stalls", "client_stalls", "shared_stamps")
_TABLES = ("unattributed", "errors", "retried_attempts")
