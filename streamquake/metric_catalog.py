"""Every metric a scenario can name, once: its kind and unit, which way is better, whether a
timeout can cut it off, whether an SLO may gate on it, and how the reports say and show it.

The schema (which names an SLO, an abort condition or ``recovery.metrics`` accepts), the stats
(loadgen/metrics.py), the scoring's saturation rule, compare, history, the live view, the
per-second series and CDFs, Prometheus and the reports' tables and sentences all take their
lists from here, and tests/test_metric_catalog.py holds every one of them to it. Adding a
metric is an entry here plus the code that measures it (loadgen/samples.py, loadgen/tally.py,
``Stats``; for a chart or a comparison, the code that reads it from a request's sample).

The order is the one the stats' JSON keys, the schema's error messages and the comparisons
follow: histograms, then rates, then what is judged once per fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["histogram", "rate", "per_fault"]
Unit = Literal["ms", "s", "tokens/s", "fraction"]
Stat = Literal["p50", "p95", "p99", "value"]


@dataclass(frozen=True)
class MetricInfo:
    name: str
    title: str               # its short name in charts and sentences: "TTFT"
    about: str               # what it measures, in a line (Prometheus' help where exported)
    kind: Kind = "histogram"  # judged by a percentile; a rate: a share of trials; per_fault:
                              #   one value per judged fault (recovery_time_s)
    unit: Unit = "ms"         # a rate is a fraction (0.012), said as a percentage (1.2%)
    higher_is_better: bool = False
    censorable: bool = False  # a request's timeout can cut it off: known then only as "at
                              #   least" (loadgen/metrics.py, "Censored values")
    gates: bool = True        # an SLO may name it (and, a histogram, ``recovery.metrics``)
    aborts: bool = False      # an abort condition may name it: the live samples hold it
                              #   (run/watch.py); arrivals never sent and schedules they lack
    timing: bool = True       # a saturated load generator distorts it: its checks are not
                              #   judged then (run/saturation.py)
    # The summary table's rows (reports/table.py): (label, stat; None for a rate's value).
    rows: tuple[tuple[str, str | None], ...] = ()
    compared: tuple[Stat, ...] = ()   # what ``streamquake compare`` judges between runs
    stored: tuple[Stat, ...] = ()     # what the history store keeps of each run
    watched: tuple[Stat, ...] = ()    # ... and ``streamquake history`` watches for regressions
    series: bool = False      # per-second p50/p95 on the timeline (run/series.py)
    cdf: bool = False         # a CDF per phase in the report (run/series.py)
    live: bool = False        # rolling p50/p95 in the live view (run/watch.py)
    prometheus: str | None = None   # exported while the run lasts: streamquake_<this>_seconds


_TAIL: tuple[Stat, ...] = ("p50", "p95", "p99")
_MIDDLE: tuple[Stat, ...] = ("p50", "p95")

CATALOG: tuple[MetricInfo, ...] = (
    MetricInfo("ttfb_ms", "TTFB", "Request sent to first response byte",
               censorable=True, aborts=True, rows=(("TTFB p95 ms", "p95"),),
               compared=_MIDDLE, stored=_TAIL, watched=("p95",),
               series=True, cdf=True, live=True, prometheus="ttfb"),
    MetricInfo("ttft_ms", "TTFT", "Request sent to first generated text",
               censorable=True, aborts=True,
               rows=(("TTFT p50 ms", "p50"), ("TTFT p95 ms", "p95")),
               compared=_MIDDLE, stored=_TAIL, watched=_MIDDLE,
               series=True, cdf=True, live=True, prometheus="ttft"),
    MetricInfo("itl_ms", "ITL", "Gap between content events",
               censorable=True, aborts=True,
               rows=(("ITL p50 ms", "p50"), ("ITL p95 ms", "p95")),
               compared=_MIDDLE, stored=_TAIL, watched=_MIDDLE,
               series=True, cdf=True, live=True, prometheus="itl"),
    MetricInfo("e2e_ms", "E2E", "Request sent to end of stream (successful requests)",
               censorable=True, aborts=True, rows=(("E2E p95 ms", "p95"),),
               compared=_MIDDLE, stored=_TAIL, watched=_MIDDLE,
               series=True, cdf=True, live=True, prometheus="e2e"),
    MetricInfo("output_tokens_per_s", "Output tokens/s per stream",
               "Output tokens over first token to end of stream (successful requests)",
               unit="tokens/s", higher_is_better=True, aborts=True,
               rows=(("tokens/s p50", "p50"),),
               compared=("p50",), stored=("p50",), watched=("p50",), series=True),
    MetricInfo("queue_delay_ms", "queue delay",
               "Open loop: an arrival's due time to its attempt's start",
               rows=(("queue delay p95 ms", "p95"),)),
    MetricInfo("ttft_scheduled_ms", "TTFT from schedule",
               "Open loop: due time to first generated text (queue delay + TTFT)",
               censorable=True, rows=(("TTFT p95 from schedule ms", "p95"),)),
    MetricInfo("e2e_scheduled_ms", "E2E from schedule",
               "Open loop: due time to end of stream (successful requests)", censorable=True),
    MetricInfo("send_ms", "send", "Attempt start to request written (pool, connect, write)",
               rows=(("send p95 ms (connect + write)", "p95"),)),
    MetricInfo("dns_ms", "DNS", "Name resolution for a new connection",
               rows=(("send: DNS p95 ms", "p95"),)),
    MetricInfo("connect_ms", "connect", "TCP connect for a new connection",
               rows=(("send: connect p95 ms", "p95"),)),
    MetricInfo("tls_ms", "TLS handshake", "TLS handshake for a new connection",
               rows=(("send: TLS handshake p95 ms", "p95"),)),
    MetricInfo("write_ms", "write", "Connection ready to request written",
               rows=(("send: write p95 ms", "p95"),)),
    MetricInfo("ttfa_ms", "TTFA", "Request sent to the answer's first token, after reasoning",
               rows=(("TTFA p95 ms (answer after reasoning)", "p95"),)),
    MetricInfo("error_rate", "errors", "Failed requests over requests",
               kind="rate", unit="fraction", aborts=True, timing=False,
               rows=(("errors", None),),
               compared=("value",), stored=("value",), watched=("value",)),
    # A stall is a gap longer than a limit, which a late reader makes: a timing.
    MetricInfo("stall_rate", "stall rate", "Successful requests with a stall, over successes",
               kind="rate", unit="fraction", aborts=True,
               rows=(("stall rate", None),), compared=("value",), stored=("value",)),
    MetricInfo("chunk_loss", "chunk loss", "SSE events missing by id over events sent",
               kind="rate", unit="fraction", aborts=True, timing=False,
               rows=(("chunk loss", None),), compared=("value",), stored=("value",)),
    MetricInfo("not_sent_rate", "arrivals not sent",
               "Open loop: arrivals due and never sent over arrivals due",
               kind="rate", unit="fraction", timing=False),
    MetricInfo("usage_deficit", "usage tokens not seen as events",
               "Usage's output tokens that never arrived as events, over usage's tokens",
               kind="rate", unit="fraction", timing=False,
               rows=(("usage tokens not seen as events", None),)),
    MetricInfo("prompt_cache_reuse", "prompt tokens from cache",
               "Prompt tokens the server read from its prefix cache (llama-server's "
               "timings.cache_n), over the prompt tokens of the requests that said",
               kind="rate", unit="fraction", higher_is_better=True, gates=False, timing=False,
               rows=(("prompt tokens from cache", None),)),
    MetricInfo("recovery_time_s", "recovery time",
               "Per judged fault: its revert to back within tolerance of baseline",
               kind="per_fault", unit="s"),
)

METRICS: dict[str, MetricInfo] = {m.name: m for m in CATALOG}


def names(kind: Kind | None = None, **flags: bool) -> tuple[str, ...]:
    """The catalog's names, in its order, of ``kind`` and with each flag as given:
    ``names("rate", aborts=True)``."""
    return tuple(m.name for m in CATALOG if (kind is None or m.kind == kind)
                 and all(getattr(m, f) == want for f, want in flags.items()))


HISTOGRAM_METRICS: tuple[str, ...] = names("histogram")
RATE_METRICS: tuple[str, ...] = names("rate")
GATING_METRICS: tuple[str, ...] = names(gates=True)
ABORT_METRICS: tuple[str, ...] = names(aborts=True)
CENSORABLE: tuple[str, ...] = names(censorable=True)
HIGHER_IS_BETTER: frozenset[str] = frozenset(names(higher_is_better=True))
TIMING_METRICS: frozenset[str] = frozenset(names(timing=True))
# One value per judged fault (run/recovery_time.py), in seconds; "never came back" breaks it.
RECOVERY_TIME = "recovery_time_s"


def unit_text(metric: str) -> str:
    """What follows a figure of ``metric``: `` ms``, `` tokens/s``, `` s``; nothing for a rate
    (said as a percentage) or a name the catalog lacks."""
    m = METRICS.get(metric)
    return "" if m is None or m.kind == "rate" else f" {m.unit}"


def stat_percentile(stat: str) -> float | None:
    """``"p95"`` -> 95.0; ``"value"`` (a rate's) -> None."""
    return None if stat == "value" else float(stat[1:])
