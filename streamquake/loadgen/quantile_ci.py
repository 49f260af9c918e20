"""Confidence intervals for percentiles and rates: order statistics, and batch means for samples
that depend on each other.

For n independent samples and the p-quantile q, the number of samples below q is Binomial(n, p)
whatever the distribution; so [x_(l), x_(u)] (1-based order statistics) covers q with probability
P(l <= B <= u - 1). We take the narrowest such ranks with at most (1 - confidence) / 2 in each
tail. With too few samples there is no such rank on one side (for p95 from 24 requests,
0.95^24 = 0.29 > 0.025: nothing observed bounds the 95th percentile from above), and the bound
is reported as missing rather than invented. Exact binomial sums up to 5,000 samples, the
normal approximation beyond (where it is within a rank of exact).

Requests that queue behind each other are not independent: one slow stretch of a run makes many
consecutive latencies slow (and many consecutive requests fail), so the share of values under q
varies from run to run far more than Binomial(n, p) says, and the interval above is too narrow
(at 85% of an M/M/16 queue's capacity, a 95% interval for p50 from two minutes of requests
covers the true median a third of the time). So each phase is also cut into
:data:`BATCHES` equal stretches of time (loadgen/batches.py counts each stretch's values and
trials), and the variance of the share at or under the estimate is measured between batches:
batch means, as a ratio estimator over batches of unequal size (Var = B/(B-1) * sum((k_b - R
n_b)^2) / N^2). Its ratio to the binomial variance is the design effect; the samples count as
n* = n / deff * (z / t_{B-1})^2 independent ones (the t factor: the variance itself is estimated
from B batches; Korn and Graubard's effective sample size for survey proportions, 1998), and the
interval is the order-statistic (or Wilson) interval of n* samples, mapped back to the phase's
values. Batch means only see dependence shorter than a batch, so this is done with 16, 8 and 4
batches and the smallest n* counts: the coarsest catches long queueing episodes (at the price of
3 degrees of freedom), the finest costs least when there are none. The final interval is the
wider of the independent one and this one, so n* <= n. With fewer than 2 batches holding
samples (everything within one stretch), or a share of 0 or 1, nothing can be said about
dependence and the independent interval stands. tests/test_quantile_ci.py measures the coverage
on simulated M/M/c queues.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_EXACT_UP_TO = 5000
BATCHES = 16                       # equal stretches of time per phase (loadgen/batches.py)
BATCH_LEVELS = (16, 8, 4)          # batch counts whose design effects are compared


def normal_quantile(confidence: float) -> float:
    # Two-sided normal quantile by bisection on erf (no SciPy): enough digits for ranks.
    lo, hi, target = 0.0, 10.0, confidence
    for _ in range(60):
        mid = (lo + hi) / 2
        if math.erf(mid / math.sqrt(2)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rank_bounds(n: int, p: float, confidence: float = 0.95) -> tuple[int | None, int | None]:
    """1-based ranks (l, u) of the order statistics bounding the p-quantile (0 < p < 1);
    None for a side that no rank can bound at this confidence."""
    if n <= 0:
        return None, None
    tail = (1.0 - confidence) / 2.0
    if n > _EXACT_UP_TO:
        mean, sd = n * p, math.sqrt(n * p * (1 - p))
        half = normal_quantile(confidence) * sd
        lo_rank = math.floor(mean - half)
        up_rank = math.ceil(mean + half) + 1
        return (lo_rank if lo_rank >= 1 else None), (up_rank if up_rank <= n else None)
    # cdf[k] = P(B <= k), by the pmf recurrence in log space to stay finite for large n.
    log_p, log_q = math.log(p), math.log1p(-p)
    log_pmf = n * log_q
    cdf, total = [], 0.0
    for k in range(n + 1):
        total += math.exp(log_pmf)
        cdf.append(min(1.0, total))
        if k < n:
            log_pmf += math.log(n - k) - math.log(k + 1) + log_p - log_q
    low: int | None = None
    for rank in range(n, 0, -1):                 # the largest l with P(B <= l - 1) <= tail
        if cdf[rank - 1] <= tail:
            low = rank
            break
    up: int | None = None
    for rank in range(1, n + 1):                 # the smallest u with P(B >= u) <= tail
        if 1.0 - cdf[rank - 1] <= tail:
            up = rank
            break
    return low, up


def min_samples_for_upper_bound(p: float, confidence: float = 0.95) -> int:
    """The fewest samples for which some observation bounds the p-quantile from above."""
    return math.ceil(math.log((1 - confidence) / 2) / math.log(p))


def t_quantile(confidence: float, dof: int) -> float:
    """Two-sided Student t quantile for ``dof`` >= 1 degrees of freedom, by bisection on the
    closed form of P(|T| <= t) for integer dof (Abramowitz and Stegun 26.7.3, 26.7.4)."""

    def inside(t: float) -> float:
        theta = math.atan(t / math.sqrt(dof))
        cos2, sin = math.cos(theta) ** 2, math.sin(theta)
        first, odd = (math.cos(theta), 3) if dof % 2 else (1.0, 2)
        if dof == 1:
            return 2 / math.pi * theta
        term = acc = first
        for k in range(odd, dof - 1, 2):
            term *= cos2 * (k - 1) / k
            acc += term
        return 2 / math.pi * (theta + sin * acc) if dof % 2 else sin * acc

    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        if inside(mid) < confidence:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _level(pairs: Sequence[tuple[int, int]], batches: int, z: float, confidence: float
           ) -> float | None:
    """n* from ``pairs`` (k_b, n_b) in time order, summed into ``batches`` batches."""
    size = len(pairs) // batches
    merged = [(sum(k for k, _ in pairs[i:i + size]), sum(n for _, n in pairs[i:i + size]))
              for i in range(0, size * batches, size)]
    merged = [(k, n) for k, n in merged if n]
    total = sum(n for _, n in merged)
    share = sum(k for k, _ in merged) / total if total else 0.0
    if len(merged) < 2 or not 0.0 < share < 1.0:
        return None
    b = len(merged)
    variance = b / (b - 1) * sum((k - share * n) ** 2 for k, n in merged) / total ** 2
    deff = max(1.0, variance / (share * (1 - share) / total))
    return total / deff * (z / t_quantile(confidence, b - 1)) ** 2


def effective_samples(pairs: Sequence[tuple[int, int]], confidence: float = 0.95
                      ) -> float | None:
    """n*, the independent samples that the batches (k_b at or under the estimate, n_b in all,
    in time order, :data:`BATCHES` of them) are worth, the smallest over :data:`BATCH_LEVELS`;
    None when no level can say (fewer than 2 batches hold samples, or a share of 0 or 1)."""
    z = normal_quantile(confidence)
    found = [n for b in BATCH_LEVELS if b <= len(pairs)
             if (n := _level(pairs, b, z, confidence)) is not None]
    return min(found) if found else None
