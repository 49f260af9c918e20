"""Order-statistic confidence intervals: their coverage is checked by simulation against a known
distribution, and the small-sample case says there is no bound instead of inventing one."""

from __future__ import annotations

import math
import random

import pytest

from streamquake.loadgen.quantile_ci import min_samples_for_upper_bound, rank_bounds


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
