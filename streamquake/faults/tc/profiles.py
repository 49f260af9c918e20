"""Named network paths as netem parameters: what a client sees from ``same-az``, ``cross-region``.

Each profile reproduces a class of path by its time to first byte (TTFB) as a streaming client
measures it against a hosted LLM endpoint: ``same-az`` about 82 ms median and 290 ms at P95 (client
in the provider's availability zone: the spread is queueing and load balancing, not distance);
``cross-region`` about 210 ms median and 640 ms at P95 (another region: distance, more hops, a
longer heavy tail).

How the numbers become netem parameters: against the embedded target, which sends its first
byte at once, a request on a kept-alive connection crosses the delayed direction once, so its
TTFB is one netem delay sample, ``delay + jitter * t`` with ``t`` drawn from the distribution
table. The tables are shapes in units of ``jitter`` (iproute2's ``*.dist``); ``paretonormal`` has
the long right tail that these paths show. Solving ``delay + jitter * q50 = median`` and
``delay + jitter * q95 = p95`` with the table's own quantiles gives ``delay`` and ``jitter``
(quantiles of iproute2's paretonormal.dist: q50 = -0.2405, q95 = +1.6196). Samples that would be
negative are sent at once, which leaves the median and P95 untouched.

Not emulated: bandwidth (add a ``rate`` or a tbf fault), loss (none is typical on either path),
and delay correlation (netem's correlation reshapes the distribution and would move the P95).
"""

from __future__ import annotations

from dataclasses import dataclass

# Quantiles of iproute2's paretonormal.dist, in units of jitter (table value / 8192).
_PARETONORMAL_Q50 = -0.240478515625
_PARETONORMAL_Q95 = 1.61962890625


@dataclass(frozen=True)
class NetProfile:
    name: str
    emulates: str
    ttfb_median_ms: float
    ttfb_p95_ms: float
    distribution: str = "paretonormal"

    @property
    def jitter_ms(self) -> float:
        return (self.ttfb_p95_ms - self.ttfb_median_ms) / (_PARETONORMAL_Q95 - _PARETONORMAL_Q50)

    @property
    def delay_ms(self) -> float:
        return self.ttfb_median_ms - self.jitter_ms * _PARETONORMAL_Q50

    def netem_fields(self) -> dict[str, str]:
        """The profile as a netem fault's fields, in the units people write them."""
        return {
            "delay": f"{self.delay_ms:.1f}ms",
            "jitter": f"{self.jitter_ms:.1f}ms",
            "distribution": self.distribution,
        }


PROFILES: dict[str, NetProfile] = {
    p.name: p
    for p in (
        NetProfile(
            "same-az",
            "client in the endpoint's availability zone: TTFB ~82 ms median, ~290 ms P95",
            ttfb_median_ms=82.0,
            ttfb_p95_ms=290.0,
        ),
        NetProfile(
            "cross-region",
            "client in another region: TTFB ~210 ms median, ~640 ms P95",
            ttfb_median_ms=210.0,
            ttfb_p95_ms=640.0,
        ),
    )
}


def get_profile(name: str) -> NetProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown network profile {name!r}; known profiles: {known}") from None
