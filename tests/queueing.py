"""An M/M/c queue, simulated and in closed form: the autocorrelated latencies of requests that
queue for a server's capacity (Poisson arrivals, c servers, exponential service), for the tests
of confidence intervals on dependent samples."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from streamquake.loadgen.samples import RequestSample


@dataclass(frozen=True)
class Queue:
    servers: int
    utilisation: float
    service_s: float                  # mean service time

    @property
    def rate(self) -> float:
        """Arrivals per second."""
        return self.utilisation * self.servers / self.service_s

    def erlang_c(self) -> float:
        """The probability that an arrival waits (every server busy)."""
        a, c = self.rate * self.service_s, self.servers
        below = sum(a ** k / math.factorial(k) for k in range(c))
        top = a ** c / math.factorial(c) * c / (c - a)
        return top / (below + top)

    def wait_over(self, t: float) -> float:
        """P(wait > t): a waiting arrival waits Exp(c mu - lambda)."""
        return self.erlang_c() * math.exp(-(self.servers / self.service_s - self.rate) * t)

    def sojourn_quantile(self, p: float) -> float:
        """The p-quantile (0 < p < 1) of wait + service, in seconds, by bisection on its
        survival function: (1 - C) e^(-mu t) + C P(Exp(theta) + Exp(mu) > t)."""
        mu, c_wait = 1.0 / self.service_s, self.erlang_c()
        theta = self.servers * mu - self.rate

        def survival(t: float) -> float:
            both = (theta * math.exp(-mu * t) - mu * math.exp(-theta * t)) / (theta - mu)
            return (1 - c_wait) * math.exp(-mu * t) + c_wait * both

        lo, hi = 0.0, 1000.0 * self.service_s
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if survival(mid) > 1 - p else (lo, mid)
        return lo

    def run(self, rng: random.Random, start: float, end: float
            ) -> list[tuple[float, float, float]]:
        """(arrival, wait, service) in seconds, in arrival order, from an empty system at
        ``start`` to ``end`` (first come, first served)."""
        free = [start] * self.servers
        t, out = start, []
        while True:
            t += rng.expovariate(self.rate)
            if t >= end:
                return out
            begin = max(t, heapq.heappop(free))
            service = rng.expovariate(1.0 / self.service_s)
            heapq.heappush(free, begin + service)
            out.append((t, begin - t, service))


def requests(jobs: list[tuple[float, float, float]], timeout_s: float | None = None
             ) -> list[RequestSample]:
    """One open-loop request per job, due and sent at its arrival: TTFT is wait + service; a
    job that waited over ``timeout_s`` failed (a timeout: such failures come in bursts)."""
    out = []
    for arrival, wait, service in jobs:
        ms = (wait + service) * 1000.0
        failed = timeout_s is not None and wait > timeout_s
        out.append(RequestSample(cls="c", sent=arrival, scheduled=arrival, ttft_ms=ms,
                                 e2e_ms=ms + 1.0, error="timeout" if failed else None))
    return out
