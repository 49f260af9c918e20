"""What the reports draw, computed once in the run: the per-second timeline, each phase's
latency CDF, and the environment the run ran in. Reports render these; they compute nothing."""

from __future__ import annotations

import hashlib
import json
import math
import platform
import socket
import sys
from collections.abc import Mapping, Sequence

from streamquake.jsontypes import JsonDict
from streamquake.loadgen import speedups
from streamquake.loadgen.attribution import WindowLike, window_at
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.scorecard import SERIES_METRICS, Scorecard, series_values
from streamquake.metric_catalog import names
from streamquake.result import Cdf, SecondStats
from streamquake.version import __version__

CDF_METRICS: tuple[str, ...] = names(cdf=True)     # from the metric catalog
# 1..99 in steps of 1, then the tail: enough to draw a CDF, small enough for the report.
CDF_PERCENTILES: tuple[float, ...] = (*(float(p) for p in range(1, 100)), 99.5, 99.9, 100.0)


def values_of(s: RequestSample, metric: str) -> list[float]:
    """The values ``s`` contributes to ``metric``, by the same rules as the HDR stats."""
    if metric not in SERIES_METRICS:
        raise KeyError(f"no per-request series for {metric!r}")
    return list(dict(series_values(s)).get(metric, ()))


def per_second(card: Scorecard, windows: Sequence[WindowLike],
               until: float | None = None) -> list[SecondStats]:
    """One ``SecondStats`` per second from the first phase's start to the last phase's end (or
    ``until``, when the run stopped early), from the scorecard's seconds: requests by the
    second they were due, their p50/p95 from histograms at 2 significant digits (buckets under
    1% wide), and the streams in flight at each second's middle."""
    if not windows:
        return []
    t0 = windows[0].start
    end = min(windows[-1].end, until) if until is not None else windows[-1].end
    seconds = max(0, math.ceil(end - t0))
    out = []
    started = ended = 0
    for i in range(seconds):
        mid = t0 + i + 0.5
        # Slot k counts what started (ended) in [t0 + k - 0.5, t0 + k + 0.5): so by the middle
        # of second i, slots 0..i (slot 0 holds everything before too).
        started += card.starts.get(i, 0)
        ended += card.ends.get(i, 0)
        phase = home.name if (home := window_at(mid, windows)) is not None else ""
        second = card.seconds.get(i)
        point = SecondStats(t=float(i), phase=phase,
                            sent=0 if second is None else second.sent,
                            errors=0 if second is None else second.errors,
                            in_flight=started - ended)
        for metric in SERIES_METRICS:
            hist = None if second is None else second.histogram(metric)
            point.n[metric] = 0 if hist is None else hist.total
            p50 = None if hist is None else hist.percentile(50)
            p95 = None if hist is None else hist.percentile(95)
            point.p50[metric] = None if p50 is None else p50 / 1000.0
            point.p95[metric] = None if p95 is None else p95 / 1000.0
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
        # Which of the load processes' hot loops ran compiled (they run this install, with
        # this environment): issue 36 asks reports to say.
        "read_path": speedups.describe(),
    }
