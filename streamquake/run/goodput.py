"""Goodput, as GuideLLM and AIPerf count it: the requests that met every per-request SLO, as a
share of the requests and per second; and the knee, the probed rate beyond which goodput stops
growing with the offered rate.

A request *meets every SLO* when it did not fail and, for each percentile SLO of the scenario
(those of its own class too), its own value is within the threshold: ``ttft_ms p95 <= 1s``
asks this request's TTFT to be at most 1 s. ``itl_ms`` is judged on the request's mean gap
(GuideLLM's per-request inter-token latency: the time after the first token over the gaps), so
one long stall in a long answer does not fail it (``stall_rate`` judges stalls, per step). A
value the request has not got (an answer of one token has no gap) is no count against it, as
the SLO's percentile does not count it either. Rate SLOs (``error_rate``, ``stall_rate``...)
hold for a step, not a request: goodput leaves them to the probe's verdict.

The request's measurements come from its sample (``load.samples: all``), one pass over the
probe's records: the load processes score into per-step histograms and know no SLO, and one
request's TTFT and E2E are in two histograms, so they cannot say which requests met both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from streamquake.loadgen.attribution import due_at
from streamquake.loadgen.metrics import HISTOGRAM_METRICS
from streamquake.loadgen.samples import RequestSample
from streamquake.scenario import Scenario, SLOSpec
from streamquake.scenario.schema import threshold_text

KNEE_SHARE = 0.9    # a rate whose goodput is at least this share of its requests keeps up


@dataclass(frozen=True)
class RequestSLO:
    """One percentile SLO, as a limit on each request's own value."""

    metric: str
    op: Literal["<=", ">="]
    threshold: float
    cls: str | None = None          # a class's SLO: that class's requests only

    def met(self, s: RequestSample) -> bool:
        if self.cls is not None and s.cls != self.cls:
            return True
        value = request_value(s, self.metric)
        if value is None:
            return True
        return value <= self.threshold if self.op == "<=" else value >= self.threshold

    @property
    def label(self) -> str:
        mean = " (its mean gap)" if self.metric == "itl_ms" else ""
        where = f" in class {self.cls}" if self.cls is not None else ""
        return f"{self.metric}{mean} {self.op} {threshold_text(self.metric, self.threshold)}{where}"


def request_slos(scenario: Scenario) -> list[RequestSLO]:
    """The scenario's percentile SLOs (its classes' too) as per-request limits."""
    slos: list[tuple[SLOSpec, str | None]] = [(s, None) for s in scenario.slos]
    slos += [(s, c.name) for c in scenario.load.classes for s in c.slos]
    return [RequestSLO(s.metric, "<=" if s.max is not None else ">=",
                       s.max if s.max is not None else s.min or 0.0, cls)
            for s, cls in slos if s.metric in HISTOGRAM_METRICS]


def rule_text(slos: Sequence[RequestSLO]) -> str:
    """What a request must do to count as goodput, in words."""
    limits = "".join(f", {slo.label}" for slo in slos)
    return f"did not fail{limits} (each request's own value)" if slos else "did not fail"


def request_value(s: RequestSample, metric: str) -> float | None:
    """The request's own value of a histogram metric (``itl_ms``: its mean gap)."""
    if metric == "itl_ms":
        return sum(s.itl_ms) / len(s.itl_ms) if s.itl_ms else None
    if metric == "output_tokens_per_s":
        return s.tokens_per_s
    value = getattr(s, metric)
    return None if value is None else float(value)


def meets_every_slo(s: RequestSample, slos: Sequence[RequestSLO]) -> bool:
    # A stream the client abandoned (a class's ``cancel``) was not an answer that met them.
    return s.error is None and not s.cancelled and all(slo.met(s) for slo in slos)


@dataclass(frozen=True)
class Goodput:
    """Of the requests due in a step (final attempts; each counted whenever it ended, as the
    verdicts count it), those that met every SLO."""

    good: int
    requests: int
    per_s: float                    # good ones per second of the step
    share: float | None             # good / requests (None: no request)

    @property
    def text(self) -> str:
        if self.share is None:
            return "no request"
        return f"{self.share:.0%} of {self.requests} ({self.per_s:.3g}/s)"


def goodput_of(samples: Iterable[RequestSample], start: float, end: float,
               slos: Sequence[RequestSLO]) -> Goodput:
    """Goodput of the requests due in [start, end)."""
    good = requests = 0
    for s in samples:
        if s.retried or not start <= due_at(s) < end:
            continue
        requests += 1
        good += meets_every_slo(s, slos)
    return Goodput(good, requests, good / (end - start) if end > start else 0.0,
                   good / requests if requests else None)


@dataclass(frozen=True)
class Knee:
    """The highest probed rate up to which every probed rate kept at least
    :data:`KNEE_SHARE` of its requests within every SLO (``rate``), and the lowest one that
    did not (``above``): below the knee goodput grows with the offered rate, beyond it it
    falls behind."""

    rate: float | None
    above: float | None

    @property
    def short(self) -> str:
        if self.rate is not None:
            return f"{self.rate:.3g}/s" if self.above is not None else f"at least {self.rate:.3g}/s"
        return f"below {self.above:.3g}/s" if self.above is not None else "-"

    @property
    def text(self) -> str:
        keep = f"{KNEE_SHARE:.0%} of requests within every SLO"
        if self.rate is not None and self.above is not None:
            return f"{self.rate:.3g}/s ({keep} up to it; {self.above:.3g}/s fell short)"
        if self.rate is not None:
            return f"at least {self.rate:.3g}/s ({keep} at every probed rate)"
        if self.above is not None:
            return f"below {self.above:.3g}/s (the lowest probed rate fell short of {keep})"
        return "not known (no probe measured goodput)"


def knee_of(points: Iterable[tuple[float, Goodput]]) -> Knee:
    """The knee over (rate offered, its goodput) points; points at one rate are pooled, and a
    point with no request says nothing."""
    pooled: dict[float, list[int]] = {}
    for offered, g in points:
        counts = pooled.setdefault(offered, [0, 0])
        counts[0] += g.good
        counts[1] += g.requests
    kept = {r: good >= KNEE_SHARE * n for r, (good, n) in pooled.items() if n}
    above = min((r for r, ok in kept.items() if not ok), default=None)
    rate = max((r for r, ok in kept.items() if ok and (above is None or r < above)),
               default=None)
    return Knee(rate, above)
