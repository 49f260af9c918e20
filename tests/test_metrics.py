"""HDR aggregation of samples: precision to ~0.1 ms, which samples feed which metric, rates."""

from __future__ import annotations

import random

import pytest

from streamquake.loadgen.metrics import HISTOGRAM_METRICS, RATE_METRICS, Stats
from streamquake.loadgen.samples import RequestSample


def ok(**kw: object) -> RequestSample:
    fields: dict[str, object] = {"cls": "chat", "sent": 1000.0, "ttfb_ms": 5.0, "ttft_ms": 200.0,
                                 "e2e_ms": 1480.0, "output_tokens": 64, "status": 200}
    fields.update(kw)
    return RequestSample(**fields)  # type: ignore[arg-type]


def exact_percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(round(p / 100 * len(ordered) + 0.5)) - 1)]


@pytest.mark.timeout(20)
def test_percentiles_match_exact_ones_to_a_tenth_of_a_millisecond() -> None:
    rng = random.Random(7)
    ttfts = [rng.lognormvariate(5.3, 0.4) for _ in range(5000)]   # ~200 ms, tail to ~700 ms
    stats = Stats.from_samples(ok(ttft_ms=v, e2e_ms=v + 1000) for v in ttfts)
    for p in (50, 90, 95, 99):
        got = stats.percentile("ttft_ms", p)
        assert got == pytest.approx(exact_percentile(ttfts, p), abs=0.1), p
    assert stats.max("ttft_ms") == pytest.approx(max(ttfts), abs=0.1)
    assert stats.mean("ttft_ms") == pytest.approx(sum(ttfts) / len(ttfts), abs=0.1)
    assert stats.count("ttft_ms") == 5000


@pytest.mark.timeout(10)
def test_values_a_tenth_of_a_millisecond_apart_stay_apart() -> None:
    stats = Stats.from_samples([ok(itl_ms=[20.0] * 50 + [20.1] * 50)])
    assert stats.percentile("itl_ms", 25) == pytest.approx(20.0, abs=0.01)
    assert stats.percentile("itl_ms", 75) == pytest.approx(20.1, abs=0.01)


@pytest.mark.timeout(10)
def test_which_samples_feed_which_metric() -> None:
    samples = [
        ok(itl_ms=[20.0, 22.0]),
        ok(ttft_ms=300.0, e2e_ms=900.0, error="truncated", itl_ms=[500.0]),
        RequestSample(cls="chat", sent=1.0, e2e_ms=0.3, error="connect"),
        ok(scheduled=999.9, sent=1000.0),
    ]
    stats = Stats.from_samples(samples)
    assert stats.requests == 4 and stats.successes == 2
    assert stats.errors == {"connect": 1, "timeout": 0, "http_status": 0, "protocol": 0,
                            "truncated": 1, "tls": 0, "content_type": 0,
                            "unsupported_encoding": 0, "limit": 0, "tool_call": 0,
                            "stream_error": 0, "safety_stop": 0}
    assert stats.count("ttfb_ms") == 3                        # connect failure had no response
    assert stats.count("ttft_ms") == 3                        # the truncated stream's TTFT counts
    assert stats.max("ttft_ms") == pytest.approx(300.0, abs=0.1)
    assert stats.count("itl_ms") == 3
    assert stats.count("e2e_ms") == 2                         # successes only
    assert stats.max("e2e_ms") == pytest.approx(1480.0, abs=0.2)
    assert stats.count("queue_delay_ms") == 1
    assert stats.percentile("queue_delay_ms", 50) == pytest.approx(100.0, abs=0.1)
    # 64 tokens over e2e - ttft = 1.28 s.
    assert stats.percentile("output_tokens_per_s", 50) == pytest.approx(50.0, abs=0.01)


@pytest.mark.timeout(10)
def test_rates() -> None:
    samples = [ok(stalls=2, missing_events=3, expected_events=70),
               ok(missing_events=0, expected_events=70),
               ok(), ok(),
               ok(error="timeout", stalls=1, missing_events=1, expected_events=10)]
    stats = Stats.from_samples(samples)
    assert stats.value("error_rate") == pytest.approx(1 / 5)
    assert stats.value("stall_rate") == pytest.approx(1 / 4)   # of successful requests
    assert stats.value("chunk_loss") == pytest.approx(4 / 150)
    with pytest.raises(KeyError, match="unknown rate metric"):
        stats.value("ttft_ms")
    with pytest.raises(KeyError, match="unknown metric"):
        stats.percentile("error_rate", 50)


@pytest.mark.timeout(10)
def test_empty_stats_say_nothing_rather_than_zero() -> None:
    stats = Stats.from_samples([])
    assert stats.percentile("ttft_ms", 95) is None
    assert all(stats.value(m) is None for m in RATE_METRICS)
    d = stats.to_dict()
    assert d["requests"] == 0 and d["ttft_ms"] == {
        "count": 0, "censored": 0, "mean": None, "p50": None, "p90": None, "p95": None,
        "p99": None, "max": None, "at_least": []}


@pytest.mark.timeout(10)
def test_to_dict_has_every_metric_and_rate() -> None:
    d = Stats.from_samples([ok(itl_ms=[20.0])]).to_dict()
    assert set(HISTOGRAM_METRICS) <= d.keys() and set(RATE_METRICS) <= d.keys()
    assert d["itl_ms"]["count"] == 1 and d["itl_ms"]["p99"] == pytest.approx(20.0, abs=0.01)
    assert d["error_rate"] == 0.0


def test_each_rates_trials_are_counted_in_the_time_batch_of_the_request() -> None:
    """Per time batch, each rate metric's k and n (what its effective sample count reads): in
    all, each batch's add up to the whole's, metric by metric, and each request's land in the
    batch of when it was due."""
    from streamquake.loadgen.batches import TimeBatches
    from streamquake.loadgen.metrics import _TRIALS

    batches = TimeBatches.over(1000.0, 1100.0)
    assert batches is not None
    stats = Stats(batches=batches)
    rng = random.Random(3)
    for i in range(300):
        kind = rng.choice(["ok", "stall", "error", "usage", "cache", "lost"])
        sent = 1000.0 + i / 3
        s = ok(sent=sent, usage_tokens=70, content_events=64, expected_events=64)
        if kind == "stall":
            s.stalls = 1
        elif kind == "error":
            s.error = "timeout"
        elif kind == "usage":
            s.content_events = 60
        elif kind == "cache":
            s.cache_n, s.prompt_n = 30, 10
        elif kind == "lost":
            s.missing_events = 2
        stats.add_sent(s)
        stats.add_outcome(s)
        if i % 7 == 0:
            stats.add_not_sent(sent)
    for metric in RATE_METRICS:
        rows = batches.of_rate(metric)
        assert (sum(k for k, _ in rows), sum(n for _, n in rows)) == stats.trials(metric), metric
        assert stats.trials(metric)[1] > 0, metric     # every rate had trials to count
    # The first request (ok, due at 1000.0) is in the first batch: one request, no error.
    k, n = batches.of_rate("error_rate")[0]
    assert n >= 1 and _TRIALS["error_rate"] == ("error_count", "requests")
