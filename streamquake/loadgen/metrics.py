"""Per-request measurements folded into full-precision HDR histograms and rates, for SLO
verdicts.

Locust's own statistics round response times into coarse buckets; verdicts come from here.
Times are recorded in microseconds with 4 significant digits: 0.1 ms resolution up to ~1.6 s,
1 ms up to ~16 s. Which samples feed which metric:

* ``ttfb_ms``, ``ttft_ms``, ``itl_ms``: every request that measured them, failed ones too (a
  stream cut after its first token still showed its user that first token). ``ttfa_ms``, the
  first token of the answer after any reasoning, likewise.
* ``e2e_ms``, ``output_tokens_per_s``: successful requests only; a failed stream's end time
  says how it failed, not how long a completion takes. Tokens/s leaves out the streams that
  arrived in bursts (``RequestSample.tokens_per_s``): their pace was the bursts'.
* ``queue_delay_ms``: open-loop requests (attempt start - scheduled), failed or not.
* ``send_ms``: every request whose last byte was written: the attempt's start to that moment
  (a free pooled connection, or a new one's connect, then the write). TTFB, TTFT and E2E are
  timed from the write, so a slow connect or a client late to write shows here, not in them.
* ``dns_ms``, ``connect_ms``, ``tls_ms``: the requests that opened a connection and resolved a
  name, connected, or shook hands for it (a reused connection has none); ``write_ms``: every
  request written, its connection ready to its last byte written.
* ``ttft_scheduled_ms``, ``e2e_scheduled_ms``: open loop, TTFT and E2E timed from when the
  request was due rather than sent (queue delay + TTFT), so a client that falls behind cannot
  hide the wait (coordinated omission; wrk2's and k6's corrected latency).
* ``not_sent_rate``: open-loop arrivals due but never sent, over all arrivals due.

``add`` takes a whole request; the scoring (loadgen/scorecard.py ``attribute``) adds each of a
request's measurements to the step it was due in (``add_first_token``, ``add_gaps``,
``add_outcome``...), whenever it ended, and counts those that ended after the step in
``ended_after``.

**Censored values.** A measurement that a clock cut off (the request's timeout came before its
first byte, its first token, its next token or its end) has no value, only a lower bound: it
took at least that long. It is recorded as such (``add_censored``) and every percentile counts
it: a percentile is exact where the censored values cannot move it (they all lie above its
rank), else known only as a lower bound (``percentile_bound``); its interval's upper side is
then unbounded. Dropping them instead would judge a fault by the requests it hurt least.

A phase's stats (a scorecard's cells) also count each measurement in its stretch of the phase
(``batches``, loadgen/batches.py): the intervals then hold for requests that depend on each
other (loadgen/quantile_ci.py), and say how many independent values the phase is
worth (``effective_count``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.loadgen.batches import TimeBatches
from streamquake.loadgen.histogram import SparseHistogram
from streamquake.loadgen.quantile_ci import effective_samples, normal_quantile, rank_bounds
from streamquake.loadgen.samples import ERROR_KINDS, SESSION_ENDS, RequestSample
from streamquake.metric_catalog import CENSORABLE as CENSORABLE  # the catalog's, named here too
from streamquake.metric_catalog import HISTOGRAM_METRICS as HISTOGRAM_METRICS
from streamquake.metric_catalog import RATE_METRICS as RATE_METRICS
from streamquake.stats import nearest_rank

# What a measurement is counted as when it cannot be attributed to one phase (run/scoring.py):
# ``e2e_ms`` stands for the request's end, and with it its outcome, stalls and chunks.
UNATTRIBUTED: tuple[str, ...] = ("ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms", "queue_delay_ms")
_FROM_SCHEDULE = frozenset({"queue_delay_ms", "ttft_scheduled_ms", "e2e_scheduled_ms"})
# A histogram metric -> the unattributed count that stands for its measurements.
_SPANNED_AS = {"ttfb_ms": "ttfb_ms", "ttft_ms": "ttft_ms", "ttft_scheduled_ms": "ttft_ms",
               "ttfa_ms": "ttft_ms",
               "itl_ms": "itl_ms", "e2e_ms": "e2e_ms", "e2e_scheduled_ms": "e2e_ms",
               "output_tokens_per_s": "e2e_ms", "queue_delay_ms": "queue_delay_ms"}
SUMMARY_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
# The parts of send_ms that only a new connection has, and why a phase may have none.
_OPENING = {"dns_ms": "resolved a name (the target is an IP address, or every connection "
                      "was a pooled one)",
            "connect_ms": "opened a connection (every one went out on a pooled connection)",
            "tls_ms": "shook hands for TLS (plain HTTP, or every connection was a pooled one)"}

NOT_MEASURABLE = "not measurable"     # how ``Stats.unavailable`` opens such a reason
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
    # Requests the client abandoned (a class's ``cancel``): neither successes nor errors, nor
    # in ``requests``; their TTFB, TTFT and gaps before the close count, their end does not.
    cancelled: int = 0
    # Conversations (a class's ``conversation``): sessions by how they ended, counted where
    # their last turn is, and each turn's TTFT and E2E by its number (``turn_summary``).
    sessions_completed: int = 0
    sessions_failed: int = 0
    sessions_abandoned: int = 0
    turns: dict[str, SparseHistogram] = field(default_factory=dict)   # "ttft_ms/2" -> values
    # Prompt tokens read from the server's prefix cache, and all prompt tokens, over the
    # requests whose server said (llama-server's ``timings``): ``prompt_cache_reuse``.
    cache_tokens: int = 0
    prompt_tokens: int = 0
    missing_events: int = 0
    expected_events: int = 0
    stalls: int = 0                   # server stalls in the requests counted here
    client_stalls: int = 0            # gaps that were the load process's own lateness
    shared_stamps: int = 0            # inter-token gaps of events read with the one before
    # Streams that arrived in bursts (RequestSample.bunched), of those with enough content
    # events to say; and over the bunched ones: those whose first token came with the end
    # (one read), their content reads and content events.
    bunch_judged: int = 0
    bunched: int = 0
    bunched_first_with_end: int = 0
    bunched_reads: int = 0
    bunched_events: int = 0
    bunched_held: int = 0             # ... whose headers were held back with the whole answer
    # The answer's parts besides text (RequestSample.reasoning_events, tool_events): events
    # and the requests that had any; reasoning tokens as the server's usage counted them.
    reasoning_events: int = 0
    reasoning_streams: int = 0
    reasoning_tokens: int = 0
    tool_events: int = 0
    tool_streams: int = 0
    # Output tokens, where they came from: the server's usage, or (without usage) counted as
    # content events, which a proxy that drops chunks makes fewer.
    usage_tokens: int = 0             # what usage said, over successful requests that had it
    usage_unseen: int = 0             # ... less the content events that arrived, where fewer
    usage_short: int = 0              # successful requests with fewer events than usage tokens
    tokens_counted: int = 0           # successful requests with no usage: tokens counted
    answered_models: dict[str, int] = field(default_factory=dict)   # the answers' model names
    # Failed requests due here whose end fell after the phase: by kind, not in ``errors``
    # (only where a measurement must lie whole inside its window: ``attribute(strict=True)``).
    late_errors: dict[str, int] = field(default_factory=dict)
    # Measurements of requests due here that were completed after the step ended, counted here
    # all the same (every request due in a step is judged in it): by metric.
    ended_after: dict[str, int] = field(default_factory=dict)
    # Lower bounds of measurements a timeout cut off (see the module's "Censored values").
    censored: dict[str, SparseHistogram] = field(default_factory=dict)
    # Created on first use (closed loop never fills three of them); sparse, sized by use.
    histograms: dict[str, SparseHistogram] = field(default_factory=dict)
    # A phase's stretches of time, each measurement counted in its own too (loadgen/batches.py):
    # what the intervals measure how much consecutive requests depend on each other from.
    batches: TimeBatches | None = None

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
        self.add_gaps(s.itl_ms, self._due(s))
        self.add_outcome(s)

    def add_retried(self, s: RequestSample) -> None:
        # A failed attempt that was retried: its request ends in a later attempt, so it is
        # counted apart, never as a request, an error or a latency (retries hide nothing).
        kind = s.error or "unknown"
        self.retried_attempts[kind] = self.retried_attempts.get(kind, 0) + 1

    def add_sent(self, s: RequestSample) -> None:
        before, at = self._trial_counts(), self._due(s)
        self.sent += 1
        self.retries += s.attempt - 1
        for metric, ms in (("send_ms", s.send_ms), ("dns_ms", s.dns_ms),
                           ("connect_ms", s.connect_ms), ("tls_ms", s.tls_ms),
                           ("write_ms", s.write_ms)):
            if ms is not None:
                self._put(metric, ms, at)
        self._count_trials(before, at)

    def add_not_sent(self, due: float | None = None) -> None:
        before = self._trial_counts()
        self.not_sent += 1
        self._count_trials(before, due)

    def add_unattributed(self, metric: str, n: int = 1) -> None:
        self.unattributed[metric] = self.unattributed.get(metric, 0) + n

    def add_ended_after(self, metric: str, n: int = 1) -> None:
        self.ended_after[metric] = self.ended_after.get(metric, 0) + n

    def add_censored(self, metric: str, at_least_ms: float, at: float | None = None) -> None:
        """A measurement a timeout cut off: it took at least ``at_least_ms``."""
        if metric not in CENSORABLE:
            raise KeyError(f"{metric!r} cannot be censored; known: {', '.join(CENSORABLE)}")
        scaled = round(at_least_ms * _SCALE)
        hist = self.censored.get(metric)
        if hist is None:
            hist = self.censored[metric] = SparseHistogram(_SIG_FIGS)
        hist.record(scaled)
        if self.batches is not None and at is not None:
            self.batches.record(metric, at, scaled)

    def censored_count(self, metric: str) -> int:
        hist = self.censored.get(metric)
        return 0 if hist is None else hist.total

    def add_queue_delay(self, s: RequestSample) -> None:
        if (queue := s.queue_delay_ms) is not None:
            self._put("queue_delay_ms", queue, self._due(s))

    def add_first_byte(self, s: RequestSample) -> None:
        if s.ttfb_ms is not None:
            self._put("ttfb_ms", s.ttfb_ms, self._due(s))

    def add_first_token(self, s: RequestSample) -> None:
        at = self._due(s)
        if s.ttft_ms is not None:
            self._put("ttft_ms", s.ttft_ms, at)
        if s.ttfa_ms is not None:
            self._put("ttfa_ms", s.ttfa_ms, at)
        if (due := s.ttft_scheduled_ms) is not None:
            self._put("ttft_scheduled_ms", due, at)
        if s.turn is not None and s.ttft_ms is not None:
            self._put_turn("ttft_ms", s.turn, s.ttft_ms)

    def add_gaps(self, gaps_ms: list[float], at: float | None = None) -> None:
        """Inter-token gaps; ``at`` (epoch s) places them in a time batch."""
        if gaps_ms and self.batches is not None and at is not None:
            self.batches.record_ms("itl_ms", at, gaps_ms)
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

    @property
    def bunched_share(self) -> float | None:
        """Of the streams that could say, the share that arrived in bursts."""
        return self.bunched / self.bunch_judged if self.bunch_judged else None

    def add_outcome(self, s: RequestSample) -> None:
        """The request's end: counted as a request, its error or success, E2E, stalls, chunks,
        how its stream arrived."""
        before = self._trial_counts()
        self._add_outcome(s)
        self._count_trials(before, self._due(s))

    def _add_outcome(self, s: RequestSample) -> None:
        if s.session is not None:
            name = f"sessions_{s.session}"
            setattr(self, name, getattr(self, name) + 1)
        if s.cache_n is not None:
            self.cache_tokens += s.cache_n
            self.prompt_tokens += s.cache_n + (s.prompt_n or 0)
        if s.cancelled:
            self.cancelled += 1
            return
        self.requests += 1
        if (bunched := s.bunched) is not None:
            self.bunch_judged += 1
            if bunched:
                self.bunched += 1
                self.bunched_first_with_end += s.content_reads == 1
                self.bunched_reads += s.content_reads
                self.bunched_events += s.content_events
                self.bunched_held += bool(s.held)
        self.reasoning_events += s.reasoning_events
        self.reasoning_streams += s.reasoning_events > 0
        self.reasoning_tokens += s.reasoning_tokens or 0
        self.tool_events += s.tool_events
        self.tool_streams += s.tool_events > 0
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
        if s.usage_tokens is None:
            self.tokens_counted += 1
        else:
            self.usage_tokens += s.usage_tokens
            unseen = max(0, s.usage_tokens - s.content_events)
            self.usage_unseen += unseen
            self.usage_short += unseen > 0
        if s.model is not None:
            name = s.model
            if name not in self.answered_models and len(self.answered_models) >= _REASONS_PER_KIND:
                name = _OTHER_REASONS
            self.answered_models[name] = self.answered_models.get(name, 0) + 1
        if s.e2e_ms is not None:
            at = self._due(s)
            self._put("e2e_ms", s.e2e_ms, at)
            if (due := s.e2e_scheduled_ms) is not None:
                self._put("e2e_scheduled_ms", due, at)
            if (tps := s.tokens_per_s) is not None:
                self._put("output_tokens_per_s", tps, at)
            if s.turn is not None:
                self._put_turn("e2e_ms", s.turn, s.e2e_ms)

    def _put_turn(self, metric: str, turn: int, value: float) -> None:
        key = f"{metric}/{turn}"
        hist = self.turns.get(key)
        if hist is None:
            hist = self.turns[key] = SparseHistogram(_SIG_FIGS)
        hist.record(round(value * _SCALE))

    def turn_summary(self) -> JsonDict | None:
        """Conversations' figures (None without any): sessions by how they ended, and by turn
        number its TTFT (every turn that had a first token) and E2E (answered turns): count,
        mean, p50, p95, max."""
        sessions = (self.sessions_completed, self.sessions_failed, self.sessions_abandoned)
        if not self.turns and not any(sessions):
            return None
        by_turn: dict[int, JsonDict] = {}
        for key in sorted(self.turns, key=lambda k: (int(k.rsplit("/", 1)[1]), k)):
            metric, turn = key.rsplit("/", 1)
            hist = self.turns[key]
            cell: JsonDict = {"count": hist.total}
            mean = hist.mean()
            cell["mean"] = None if mean is None else mean / _SCALE
            for p in (50, 95):
                v = hist.percentile(p)
                cell[f"p{p}"] = None if v is None else v / _SCALE
            top = hist.max()
            cell["max"] = None if top is None else top / _SCALE
            by_turn.setdefault(int(turn), {})[metric] = cell
        return {"sessions": dict(zip(SESSION_ENDS, sessions, strict=True)),
                "turns": {str(k): v for k, v in by_turn.items()}}

    def _put(self, metric: str, value: float, at: float | None = None) -> None:
        scaled = round(value * _SCALE)
        self._hist_for(metric).record(scaled)
        if self.batches is not None and at is not None:
            self.batches.record(metric, at, scaled)

    def _hist_for(self, metric: str) -> SparseHistogram:
        hist = self.histograms.get(metric)
        if hist is None:
            hist = self.histograms[metric] = SparseHistogram(_SIG_FIGS)
        return hist

    @staticmethod
    def _due(s: RequestSample) -> float:
        return s.scheduled if s.scheduled is not None else s.sent

    def _trial_counts(self) -> tuple[int, ...] | None:
        """Every rate metric's (k, n), flat, in RATE_METRICS order (read in one call: twice
        a request)."""
        return None if self.batches is None else _trial_fields(self)

    def _count_trials(self, before: tuple[int, ...] | None, at: float | None) -> None:
        """Count in ``at``'s time batch what the rates' trials gained since ``before``."""
        if before is None or self.batches is None or at is None:
            return
        now = _trial_fields(self)
        if now == before:
            return
        for metric, i in _RATE_AT:
            dk, dn = now[i] - before[i], now[i + 1] - before[i + 1]
            if dk or dn:
                self.batches.count(metric, at, dk, dn)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def cancelled_share(self) -> float | None:
        """Of the requests that ended here, the share the client abandoned."""
        ended = self.requests + self.cancelled
        return self.cancelled / ended if ended else None

    @property
    def due(self) -> int:
        """Arrivals due here, sent or not."""
        return self.sent + self.not_sent

    def percentile(self, metric: str, p: float) -> float | None:
        """The ``p``-th percentile of ``metric`` (0 < p <= 100) by nearest rank, ceil(p/100 *
        n): the smallest value with at least p% of the values at or below it, which is what
        "p99 <= 300 ms" promises. None if nothing was recorded. Where censored values could
        move it, what is known: a lower bound (see :meth:`percentile_bound`)."""
        return self.percentile_bound(metric, p)[0]

    def percentile_bound(self, metric: str, p: float) -> tuple[float | None, bool]:
        """(value, exact): the ``p``-th percentile over the measured and the censored values;
        ``exact`` False when censored values (known only as "at least") could move it, and the
        value is then its lower bound."""
        n = self.samples(metric)
        if not n:
            return None, True
        rank = nearest_rank(p, n)
        low = self._at_rank(metric, rank, upper=False)
        high = self._at_rank(metric, rank, upper=True)
        return low, low is not None and high == low

    def _at_rank(self, metric: str, rank: int, upper: bool) -> float | None:
        """The value at ``rank`` among every value, measured and censored: the censored ones
        at their lower bounds (``upper`` False: the least it can be) or past every measured
        value (``upper`` True: the most it can be, None when a censored value holds it)."""
        hist = self._hist(metric)
        cens = self.censored.get(metric)
        if cens is not None and cens.total and not upper:
            merged = cens.copy() if hist is None else hist.copy()
            if hist is not None:
                merged.merge(cens)
            hist = merged
        value = None if hist is None else hist.at_rank(rank)
        return None if value is None else value / _SCALE

    def count(self, metric: str) -> int:
        """Values measured (censored ones apart: :meth:`samples` counts both)."""
        hist = self._hist(metric)
        return 0 if hist is None else hist.total

    def samples(self, metric: str) -> int:
        """The values behind a percentile: those measured and those censored."""
        return self.count(metric) + self.censored_count(metric)

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
        if metric == "usage_deficit":
            return self.usage_unseen / self.usage_tokens if self.usage_tokens else None
        if metric == "prompt_cache_reuse":
            return self.cache_tokens / self.prompt_tokens if self.prompt_tokens else None
        raise KeyError(f"unknown rate metric {metric!r}; known: {', '.join(RATE_METRICS)}")

    def percentile_interval(self, metric: str, p: float, confidence: float
                            ) -> tuple[float | None, float | None, int]:
        """(low, high, n): a distribution-free ``confidence`` interval for the ``p``-th
        percentile from order statistics, widened to hold for samples that depend on each
        other (the wider of the n-sample and the n*-sample intervals, n* from the time
        batches; loadgen/quantile_ci.py); a side no observation can bound is None."""
        n = self.samples(metric)

        def bounds(m: int) -> list[float | None]:
            # The ranks for m samples as shares of the phase's n (half a rank below lands
            # exactly on it); the lower side the least, the upper the most, censored values
            # can make it.
            ranks = rank_bounds(m, p / 100.0, confidence)
            return [None if rank is None else
                    self._at_rank(metric, nearest_rank(100.0 * (rank - 0.5) / m, n), upper)
                    for rank, upper in zip(ranks, (False, True), strict=True)]

        low, high = bounds(n)
        m = self._effective(metric, p, confidence)
        if m is not None and m < n:
            b_low, b_high = bounds(max(1, round(m)))
            low = None if low is None or b_low is None else min(low, b_low)
            high = None if high is None or b_high is None else max(high, b_high)
        return low, high, n

    def trials(self, metric: str) -> tuple[int, int]:
        """(k, n) behind a rate metric: k of n trials."""
        k, n = _TRIALS[metric]
        return getattr(self, k), getattr(self, n)

    def rate_interval(self, metric: str, confidence: float
                      ) -> tuple[float | None, float | None, int]:
        """(low, high, n): a Wilson score interval for a rate metric over its n trials, widened
        like :meth:`percentile_interval` (the wider of Wilson's for n and for n* trials)."""
        k, n = self.trials(metric)
        if n == 0:
            return None, None, 0
        z = normal_quantile(confidence)
        phat = k / n

        def wilson(m: float) -> tuple[float, float]:
            centre = (phat + z * z / (2 * m)) / (1 + z * z / m)
            half = z * math.sqrt(phat * (1 - phat) / m + z * z / (4 * m * m)) / (1 + z * z / m)
            return max(0.0, centre - half), min(1.0, centre + half)

        low, high = wilson(n)
        m = self._effective(metric, None, confidence)
        if m is not None and m < n:
            b_low, b_high = wilson(m)
            low, high = min(low, b_low), max(high, b_high)
        return low, high, n

    def effective_count(self, metric: str, p: float | None, confidence: float) -> int:
        """n*: how many independent samples the ``p``-th percentile's (None: the rate's) values
        are worth by the spread of the time batches; the count itself when they say nothing."""
        n = self.samples(metric) if p is not None else self.trials(metric)[1]
        m = self._effective(metric, p, confidence)
        return n if m is None else min(n, math.floor(m))

    def _effective(self, metric: str, p: float | None, confidence: float) -> float | None:
        """n* from the batches: each one's share at or under the percentile (or its rate)."""
        if self.batches is None:
            return None
        if p is None:
            return effective_samples(self.batches.of_rate(metric), confidence)
        estimate = self.percentile(metric, p)
        if estimate is None:
            return None
        return effective_samples(self.batches.at_or_below(metric, round(estimate * _SCALE)),
                                 confidence)

    def unavailable(self, metric: str) -> str | None:
        """Why ``metric`` has no value in these samples (None when it has one): "not
        measurable: ..." when this target or load cannot give it (:data:`NOT_MEASURABLE`),
        "no data: ..." when the requests that should have measured it did not."""
        if metric == "chunk_loss" and self.successes and not self.expected_events:
            estimate = self.value("usage_deficit")
            also = (f"; its usage counted {self.usage_tokens:,} tokens, {estimate:.1%} more "
                    "than the content events that arrived (usage_deficit)"
                    if estimate is not None else "; nor does it send usage to compare with")
            return (f"{NOT_MEASURABLE}: the server numbers none of its events (no SSE `id:` "
                    "lines), so lost chunks cannot be counted" + also)
        if metric == "prompt_cache_reuse" and (self.requests or self.cancelled) \
                and not self.prompt_tokens:
            return (f"{NOT_MEASURABLE}: the server said nothing of its prefix cache (no "
                    "llama-server `timings.cache_n` in its streams)")
        if metric == "usage_deficit" and self.successes and not self.usage_tokens:
            return (f"{NOT_MEASURABLE}: the server sent no usage (output token counts) to "
                    "compare the content events that arrived with")
        scheduled = self.not_sent or self.count("queue_delay_ms") \
            or self.unattributed.get("queue_delay_ms")
        if metric in _FROM_SCHEDULE and self.sent and not scheduled:
            return (f"{NOT_MEASURABLE}: no request here had a schedule; this metric measures "
                    "open-loop arrivals (load.arrival), not a closed loop (load.think_time)")
        if metric == "output_tokens_per_s" and self.bunched and not self.count(metric):
            return (f"{NOT_MEASURABLE}: no stream here showed its pace after the first token: "
                    f"{self.bunched} of the {self.bunch_judged} long enough to say arrived in "
                    "bursts (released together by a gateway or a throttled link), so their "
                    "pace was the bursts', not the server's")
        if metric in _OPENING and self.count("write_ms") and not self.count(metric):
            return f"{NOT_MEASURABLE}: no request written here {_OPENING[metric]}"
        spanned = self.unattributed.get(_SPANNED_AS.get(metric, ""), 0)
        if spanned and not self.samples(metric):
            return (f"no data: every measurement of it here ({spanned}) spanned the phase's "
                    "end, so none could be attributed to the phase (see `unattributed`)")
        if not self.requests and self.not_sent:
            return (f"no data: no request ended in this phase, and {self.not_sent} arrivals "
                    "due in it were never sent")
        if not self.requests:
            return "no data: no request was scored in this phase"
        return None

    def summary(self, metric: str) -> JsonDict:
        """``count`` measured values, ``censored`` ones (known as lower bounds), the mean of
        the measured, each percentile over both, and ``at_least``: the figures that censored
        values could move, so they are lower bounds (``max`` too, when any was censored)."""
        censored = self.censored_count(metric) if metric in CENSORABLE else 0
        out: JsonDict = {"count": self.count(metric), "censored": censored,
                         "mean": self.mean(metric)}
        at_least: list[JsonValue] = []
        for p in SUMMARY_PERCENTILES:
            value, exact = self.percentile_bound(metric, p)
            out[f"p{p:g}"] = value
            if not exact:
                at_least.append(f"p{p:g}")
        out["max"] = self.max(metric)
        if censored:
            cens = self.censored[metric].max()
            top = self.max(metric)
            out["max"] = max(top or 0.0, (cens or 0) / _SCALE)
            at_least.append("max")
        out["at_least"] = at_least
        return out

    def to_dict(self) -> JsonDict:
        out: JsonDict = {
            "requests": self.requests,
            "sent": self.sent,
            "not_sent": self.not_sent,
            "unattributed": dict(self.unattributed),
            "successes": self.successes,
            "retried_attempts": dict(self.retried_attempts),
            "requests_retried": self.retries,
            "cancelled": self.cancelled,
            "cancelled_share": self.cancelled_share,
            **({} if (conv := self.turn_summary()) is None else {"conversation": conv}),
            "shared_stamps": self.shared_stamps,
            "shared_stamp_share": self.shared_stamp_share,
            "bunching": {"streams": self.bunch_judged, "bunched": self.bunched,
                         "share": self.bunched_share,
                         "first_with_end": self.bunched_first_with_end,
                         "held": self.bunched_held,
                         "reads": self.bunched_reads, "events": self.bunched_events},
            "reasoning": {"streams": self.reasoning_streams, "events": self.reasoning_events,
                          "usage_tokens": self.reasoning_tokens},
            "tool_calls": {"streams": self.tool_streams, "events": self.tool_events},
            "usage_tokens": self.usage_tokens,
            "usage_unseen": self.usage_unseen,
            "usage_short": self.usage_short,
            "tokens_counted": self.tokens_counted,
            "answered_models": dict(self.answered_models),
            "late_errors": dict(self.late_errors),
            "ended_after": dict(self.ended_after),
            "errors": dict(self.errors),
            "error_reasons": {kind: {k: n for k, n in sorted(r.items(), key=lambda kv: -kv[1])}
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
        self._merge_batches(other)
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
        for mine_hists, theirs_hists in ((self.histograms, other.histograms),
                                         (self.censored, other.censored),
                                         (self.turns, other.turns)):
            for metric, hist in theirs_hists.items():
                if metric not in mine_hists:
                    mine_hists[metric] = SparseHistogram(_SIG_FIGS)
                mine_hists[metric].merge(hist)

    def _merge_batches(self, other: Stats) -> None:
        # Batches add up on one grid (one phase, cut alike in every process), and empty stats
        # take the other's; any other mix (values with batches and values without) keeps none.
        if other.batches is None:
            if not other._empty():
                self.batches = None
        elif self.batches is None:
            if self._empty():
                self.batches = TimeBatches(other.batches.grid)
                self.batches.merge(other.batches)
        elif self.batches.grid == other.batches.grid:
            self.batches.merge(other.batches)
        else:
            self.batches = None

    def _empty(self) -> bool:
        return not (self.requests or self.cancelled or self.sent or self.not_sent
                    or self.histograms or self.censored or self.turns)

    def to_wire(self) -> JsonDict:
        """Counts as numbers, histograms as standard HdrHistogram V2 histoblobs."""
        out: JsonDict = {name: getattr(self, name) for name in _COUNTERS}
        out.update({table: dict(getattr(self, table)) for table in _TABLES})
        out["error_reasons"] = {k: dict(v) for k, v in self.error_reasons.items()}
        out["histograms"] = {m: h.encode() for m, h in self.histograms.items() if h.total}
        censored: JsonDict = {m: h.encode() for m, h in self.censored.items() if h.total}
        if censored:
            out["censored"] = censored
        if self.turns:
            out["turns"] = {k: h.encode() for k, h in self.turns.items() if h.total}
        if self.batches is not None:
            out["batches"] = self.batches.to_wire()
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
        for metric, blob in data.get("censored", {}).items():
            if metric not in CENSORABLE:
                raise ValueError(f"unknown censored metric {metric!r} in a scorecard")
            stats.censored[metric] = SparseHistogram.decode(blob, _SIG_FIGS)
        for key, blob in data.get("turns", {}).items():
            stats.turns[str(key)] = SparseHistogram.decode(blob, _SIG_FIGS)
        if (batches := data.get("batches")) is not None:
            stats.batches = TimeBatches.from_wire(batches)
        return stats


_COUNTERS = ("requests", "sent", "not_sent", "successes", "stalled", "retries", "cancelled",
             "sessions_completed", "sessions_failed", "sessions_abandoned",
             "cache_tokens", "prompt_tokens",
             "missing_events", "expected_events", "stalls", "client_stalls", "shared_stamps",
             "usage_tokens", "usage_unseen", "usage_short", "tokens_counted",
             "bunch_judged", "bunched", "bunched_first_with_end", "bunched_reads",
             "bunched_events", "bunched_held", "reasoning_events", "reasoning_streams",
             "reasoning_tokens", "tool_events", "tool_streams")
_TABLES = ("unattributed", "errors", "retried_attempts", "answered_models", "late_errors",
           "ended_after")

# A rate metric -> the attributes that count its k and its n.
_TRIALS = {"error_rate": ("error_count", "requests"), "stall_rate": ("stalled", "successes"),
           "chunk_loss": ("missing_events", "expected_events"),
           "not_sent_rate": ("not_sent", "due"), "usage_deficit": ("usage_unseen", "usage_tokens"),
           "prompt_cache_reuse": ("cache_tokens", "prompt_tokens")}
_trial_fields = operator.attrgetter(*(name for m in RATE_METRICS for name in _TRIALS[m]))
_RATE_AT = tuple((m, 2 * i) for i, m in enumerate(RATE_METRICS))   # where its k and n are
