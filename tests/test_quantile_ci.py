"""Order-statistic confidence intervals: their coverage is checked by simulation against a known
distribution, and the small-sample case says there is no bound instead of inventing one."""

from __future__ import annotations

import copy
import math
import random

import pytest

from streamquake.loadgen.attribution import Window
from streamquake.loadgen.batches import TimeBatches
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.quantile_ci import min_samples_for_upper_bound, rank_bounds
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.scorecard import Scorecard
from tests.queueing import Queue, requests


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "p"), [(40, 0.5), (200, 0.95), (1000, 0.99), (8000, 0.95)])
def test_intervals_cover_the_true_quantile_at_least_as_often_as_claimed(n: int, p: float) -> None:
    rng = random.Random(7)
    low, up = rank_bounds(n, p)
    assert low is not None and up is not None and low < up
    true_q = -math.log(1 - p)       # the p-quantile of Exp(1)
    trials, covered = 400, 0
    for _ in range(trials):
        xs = sorted(rng.expovariate(1.0) for _ in range(n))
        covered += xs[low - 1] <= true_q <= xs[up - 1]
    # 95% nominal; 400 trials put the observed share within about 2.2 points (1 sd) of it.
    assert covered / trials >= 0.90, covered / trials


@pytest.mark.timeout(10)
def test_too_few_samples_have_no_upper_bound_for_a_high_percentile() -> None:
    assert min_samples_for_upper_bound(0.95) == 72
    assert rank_bounds(24, 0.95)[1] is None            # a p95 of 24 requests bounds nothing above
    assert rank_bounds(72, 0.95)[1] == 72
    assert rank_bounds(0, 0.5) == (None, None)


# At 85% of 16 servers' capacity (0.5 s each), a phase of two minutes is ~3,300 requests that
# queue behind each other (the queue's relaxation time is ~5 s: the phase holds ~25 of them);
# the true percentiles and error rate come from the queue's closed form.
QUEUE = Queue(servers=16, utilisation=0.85, service_s=0.5)
T0, PHASE_S, WARMUP_S = 1_700_000_000.0, 120.0, 30.0
TIMEOUT_S = 0.25                      # a request that waited longer failed: ~13% of them


def _covers(low: float | None, high: float | None, true: float) -> bool:
    return (low is None or low <= true) and (high is None or true <= high)


@pytest.mark.timeout(400)     # hang-only: 142 s at load average 12 on 2 cores
def test_intervals_hold_for_the_latencies_of_requests_that_queue() -> None:
    """Through the product's path (a scorecard's phase cell, fed requests with their times),
    the 95% intervals cover the true p50, p95 and error rate in about 90% or more of 100
    independent runs; the same cells' independent-sample intervals, far less often."""
    rng = random.Random(1)
    truth = {50: QUEUE.sojourn_quantile(0.50) * 1e3, 95: QUEUE.sojourn_quantile(0.95) * 1e3}
    true_rate = QUEUE.wait_over(TIMEOUT_S)
    window = Window("baseline", T0, T0 + PHASE_S)
    runs = 100
    covered = {(how, what): 0 for how in ("batched", "independent") for what in (50, 95, "rate")}
    for _ in range(runs):
        samples = requests(QUEUE.run(rng, T0 - WARMUP_S, T0 + PHASE_S), TIMEOUT_S)
        batched = Scorecard.of([window], samples).cells[("baseline", "c")]
        independent = copy.copy(batched)
        independent.batches = None            # the same values, no time batches
        for how, stats in (("batched", batched), ("independent", independent)):
            for p in (50, 95):
                low, high, _ = stats.percentile_interval("ttft_ms", p, 0.95)
                covered[how, p] += _covers(low, high, truth[p])
            low, high, _ = stats.rate_interval("error_rate", 0.95)
            covered[how, "rate"] += _covers(low, high, true_rate)
    share = {k: v / runs for k, v in covered.items()}
    print(f"\ncoverage of 95% intervals over {runs} runs of {batched.requests} requests "
          f"(true p50 {truth[50]:.0f} ms, p95 {truth[95]:.0f} ms, error rate {true_rate:.1%}): "
          f"{share}")
    assert share["batched", 50] >= 0.88 and share["batched", 95] >= 0.90, share
    assert share["batched", "rate"] >= 0.88, share
    assert share["independent", 50] <= 0.5 and share["independent", "rate"] <= 0.3, share
    assert share["independent", 95] <= share["batched", 95] - 0.2, share
    # What the report shows beside n: the last run's values, as independent ones.
    n, worth = batched.count("ttft_ms"), batched.effective_count("ttft_ms", 50, 0.95)
    print(f"p50 from {n} values, worth {worth} independent ones")
    assert 0 < worth < n / 5


@pytest.mark.timeout(60)
def test_independent_values_keep_their_coverage_and_about_a_third_of_their_worth() -> None:
    """The price of not assuming independence: values that are independent still get intervals
    that cover (more often than claimed), as wide as about a third of them would give."""
    rng = random.Random(3)
    runs, n, covered, worth = 100, 1500, 0, 0.0
    true_p95 = -100.0 * math.log(0.05)              # Exp(mean 100 ms)
    for _ in range(runs):
        stats = Stats(batches=TimeBatches.over(T0, T0 + PHASE_S))
        for _ in range(n):
            stats.add(RequestSample(cls="c", sent=T0 + rng.uniform(0, PHASE_S),
                                    ttft_ms=rng.expovariate(1 / 100.0)))
        low, high, _ = stats.percentile_interval("ttft_ms", 95, 0.95)
        covered += _covers(low, high, true_p95)
        worth += stats.effective_count("ttft_ms", 95, 0.95) / n
    print(f"\nindependent values: p95 covered in {covered} of {runs}, worth "
          f"{worth / runs:.0%} of their count")
    assert covered / runs >= 0.95
    assert 0.25 <= worth / runs < 1.0
