"""The runner's rolling window (run/watch.py) against the plain computation it stands in for:
every sample of the window, each metric's values sorted together, nearest ranks. The watch
keeps each poll's values sorted apart and selects the ranks across them; whatever the polls
bring (out of order, across the window's edges, before and after a phase's start), its live
statistics and abort verdicts must be the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamquake.loadgen.samples import RequestSample
from streamquake.run.timeline import TICK_S
from streamquake.run.watch import (
    LATENCIES,
    LIVE_WINDOW_S,
    RollingStats,
    Watch,
    _due,
    _ended,
    _kth,
    _values,
)
from streamquake.scenario.schema import AbortCondition
from streamquake.stats import percentile

T0 = 1_800_000_000.0


def _reference(samples: list[RequestSample], now: float, since: float | None) -> RollingStats:
    """What the watch computed before it kept each poll's values apart: the window's samples,
    each metric's values sorted together."""
    window = [s for s in samples if now - LIVE_WINDOW_S <= _ended(s) <= now]
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


# Values from a small set, so that ranks fall among ties too.
_MS = st.sampled_from([0.0, 0.5, 1.0, 19.5, 20.0, 20.25, 21.0, 40.0, 100.0, 350.0])


@st.composite
def _sample(draw: st.DrawFn) -> RequestSample:
    sent = T0 + draw(st.floats(0.0, 30.0))
    s = RequestSample(cls="c", sent=sent,
                      scheduled=draw(st.one_of(st.none(), st.just(sent - 0.25))),
                      trace_id="t", span_id="s")
    s.e2e_ms = draw(st.one_of(st.none(), st.floats(0.0, 8000.0)))
    s.ttfb_ms = draw(st.one_of(st.none(), _MS))
    s.ttft_ms = draw(st.one_of(st.none(), _MS))
    s.itl_ms = draw(st.lists(_MS, max_size=12))
    s.error = draw(st.sampled_from([None, None, None, "timeout"]))
    return s


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(polls=st.lists(st.lists(_sample(), max_size=25), min_size=1, max_size=8),
       ticks=st.lists(st.tuples(st.floats(0.0, 45.0),
                                st.one_of(st.none(), st.floats(0.0, 40.0))),
                      min_size=1, max_size=4))
def test_the_rolling_window_is_the_plain_sort_of_its_samples(
        tmp_path: Path, polls: list[list[RequestSample]],
        ticks: list[tuple[float, float | None]]) -> None:
    directory = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
    directory.mkdir()
    path = directory / "samples-1.jsonl"
    watch = Watch(directory, [])
    seen: list[RequestSample] = []
    polled_at = T0
    for i, batch in enumerate(polls):
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(s.to_json() + "\n" for s in batch)
        # What the watch read back, as it read it.
        seen += [RequestSample.from_dict(json.loads(s.to_json())) for s in batch]
        polled_at = T0 + 5.0 * i
        watch.poll(polled_at)
    for at, since in ticks:
        now = polled_at + at
        since_at = None if since is None else T0 + since
        # The watch keeps what ended within its window of the last poll: a later tick asks
        # no more of it than that.
        kept = [s for s in seen if _ended(s) >= polled_at - LIVE_WINDOW_S]
        assert watch.rolling(now, since_at) == _reference(kept, now, since_at)


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.lists(st.floats(-5.0, 5.0, allow_nan=False), min_size=1, max_size=30)
                     .map(sorted), min_size=1, max_size=6),
       data=st.data())
def test_the_kth_value_of_sorted_runs_is_the_kth_of_them_all(
        runs: list[list[float]], data: st.DataObject) -> None:
    everything = sorted(v for r in runs for v in r)
    k = data.draw(st.integers(1, len(everything)))
    assert _kth(runs, k) == everything[k - 1]


@pytest.mark.parametrize("percentile_", [None, 95.0])
def test_an_abort_condition_reads_the_same_window(tmp_path: Path,
                                                  percentile_: float | None) -> None:
    """A condition over the last 5 s, from batches the window cuts: its verdict, and the
    figures it names, are those of the window's samples sorted together."""
    metric = "itl_ms" if percentile_ else "error_rate"
    condition = AbortCondition.model_validate(
        {"metric": metric, "percentile": percentile_, "above": 30.0 if percentile_ else 0.2,
         "for_s": 5.0, "min_requests": 3})
    watch = Watch(tmp_path, [condition])
    path = tmp_path / "samples-1.jsonl"
    samples = []
    for second in range(12):
        with open(path, "a", encoding="utf-8") as f:
            for j in range(4):
                s = RequestSample(cls="c", sent=T0 + second + j * 0.23, scheduled=None,
                                  trace_id="t", span_id="s")
                s.e2e_ms, s.ttfb_ms, s.ttft_ms = 900.0, 50.0, 60.0
                late = second >= 9
                s.itl_ms = [20.0, 45.0 if late else 21.0, 22.0]
                s.error = "timeout" if late and j % 2 else None
                f.write(s.to_json() + "\n")
                samples.append(s)
        watch.poll(T0 + second + 1.0)
    now = T0 + 12.4
    window = [s for s in samples if now - 5.0 <= _ended(s) <= now]
    if percentile_:
        values = sorted(_values(window, metric))
        value, n = percentile(values, percentile_), len(values)
    else:
        value, n = sum(s.error is not None for s in window) / len(window), len(window)
    assert value is not None and value > condition.above
    label = f"{metric} p95" if percentile_ else metric
    assert watch.abort_reason(now) == (
        f"abort condition '{condition.label}' held: {label} was {value:.4g} over the last 5 s "
        f"({n} values from {len(window)} requests)")
    assert watch.abort_reason(T0 + 8.0) is None
