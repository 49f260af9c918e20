"""Distribution-free confidence intervals for percentiles, from order statistics.

For n samples and the p-quantile q, the number of samples below q is Binomial(n, p) whatever
the distribution; so [x_(l), x_(u)] (1-based order statistics) covers q with probability
P(l <= B <= u - 1). We take the narrowest such ranks with at most (1 - confidence) / 2 in each
tail. With too few samples there is no such rank on one side (for p95 from 24 requests,
0.95^24 = 0.29 > 0.025: nothing observed bounds the 95th percentile from above), and the bound
is reported as missing rather than invented. Exact binomial sums up to 5,000 samples, the
normal approximation beyond (where it is within a rank of exact).
"""

from __future__ import annotations

import math

_EXACT_UP_TO = 5000


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
