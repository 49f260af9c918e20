"""What the reports draw, computed once in the run: the per-second timeline, each phase's
latency CDF, and the environment the run ran in. Reports render these; they compute nothing."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import platform
import socket
import sys
from collections.abc import Mapping, Sequence

from streamquake import __version__
from streamquake.jsontypes import JsonDict
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.result import Cdf, SecondStats
from streamquake.run.timeline import PhaseWindow

SERIES_METRICS: tuple[str, ...] = ("ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens_per_s")
CDF_METRICS: tuple[str, ...] = ("ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms")
# 1..99 in steps of 1, then the tail: enough to draw a CDF, small enough for the report.
CDF_PERCENTILES: tuple[float, ...] = (*(float(p) for p in range(1, 100)), 99.5, 99.9, 100.0)


def nearest_rank(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of sorted ``values`` by nearest rank (an observed value)."""
    if not values:
        return None
    return values[max(0, math.ceil(p / 100.0 * len(values)) - 1)]


def tokens_per_s(s: RequestSample) -> float | None:
    # The same definition as the HDR stats: successful streams, tokens after the first one.
    if s.error is not None or s.e2e_ms is None or s.ttft_ms is None or s.output_tokens <= 0:
        return None
    if s.e2e_ms <= s.ttft_ms:
        return None
    return s.output_tokens / ((s.e2e_ms - s.ttft_ms) / 1e3)


def values_of(s: RequestSample, metric: str) -> list[float]:
    """The values ``s`` contributes to ``metric``, by the same rules as the HDR stats."""
    if metric == "itl_ms":
        return list(s.itl_ms)
    if metric == "e2e_ms":   # as in the HDR stats: a failed stream's end says how it failed
        return [s.e2e_ms] if s.e2e_ms is not None and s.error is None else []
    if metric == "output_tokens_per_s":
        tps = tokens_per_s(s)
        return [] if tps is None else [tps]
    if metric not in ("ttfb_ms", "ttft_ms"):
        raise KeyError(f"no per-request series for {metric!r}")
    value = s.ttfb_ms if metric == "ttfb_ms" else s.ttft_ms
    return [] if value is None else [value]


def per_second(samples: Sequence[RequestSample], windows: Sequence[PhaseWindow],
               until: float | None = None) -> list[SecondStats]:
    """One ``SecondStats`` per second from the first phase's start to the last phase's end (or
    ``until``, when the run stopped early)."""
    if not windows:
        return []
    t0 = windows[0].start
    end = min(windows[-1].end, until) if until is not None else windows[-1].end
    seconds = max(0, math.ceil(end - t0))
    buckets: list[list[RequestSample]] = [[] for _ in range(seconds)]
    starts: list[float] = []
    ends: list[float] = []
    for s in samples:
        if s.retried:
            continue      # a retried attempt is counted apart (Stats), never as a request
        due = s.scheduled if s.scheduled is not None else s.sent
        i = math.floor(due - t0)
        if 0 <= i < seconds:
            buckets[i].append(s)
        starts.append(s.sent)
        ends.append(s.sent + (s.e2e_ms or 0.0) / 1000.0)
    starts.sort()
    ends.sort()
    out = []
    for i, bucket in enumerate(buckets):
        mid = t0 + i + 0.5
        phase = next((w.name for w in windows if w.start <= mid < w.end), "")
        point = SecondStats(
            t=float(i), phase=phase, sent=len(bucket),
            errors=sum(1 for s in bucket if s.error is not None),
            in_flight=bisect.bisect_right(starts, mid) - bisect.bisect_right(ends, mid),
        )
        for metric in SERIES_METRICS:
            values = sorted(v for s in bucket for v in values_of(s, metric))
            point.n[metric] = len(values)
            point.p50[metric] = nearest_rank(values, 50)
            point.p95[metric] = nearest_rank(values, 95)
        out.append(point)
    return out


def cdfs(stats: Mapping[str, Stats]) -> list[Cdf]:
    """Each scored phase's CDF per latency metric, read from the same HDR histograms as the
    verdicts (so a CDF's p95 is the verdict's p95)."""
    out = []
    for phase, st in stats.items():
        for metric in CDF_METRICS:
            count = st.count(metric)
            points = []
            for p in CDF_PERCENTILES:
                value = st.percentile(metric, p)
                if value is not None:
                    points.append((p, round(value, 3)))
            out.append(Cdf(phase=phase, metric=metric, count=count, points=points))
    return out


def scenario_hash(echo: JsonDict) -> str:
    """Short hash of the scenario as run (header values redacted), so runs of the same scenario
    can be told from runs of an edited one with the same name."""
    canonical = json.dumps(echo, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def environment(echo: JsonDict) -> dict[str, str]:
    return {
        "streamquake": __version__,
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "scenario_sha256": scenario_hash(echo),
    }
