"""What the time-to-recovery tests share: a synthetic run's requests, one due every ``every``
seconds, slow (200 ms to first token) until ``slow_until``, then fast (20 ms), judged against
a 20 ms baseline with 50% tolerance (a 30 ms limit) over 2 s windows."""

from __future__ import annotations

from streamquake.loadgen.samples import RequestSample
from streamquake.scenario import RecoverySpec


def due_every(start: float, end: float, every: float, slow_until: float
                       ) -> list[RequestSample]:
    """One request due every ``every`` s: 200 ms to first token until ``slow_until``, 20 after."""
    out, t = [], start
    while t < end - 1e-9:
        ttft = 200.0 if t < slow_until else 20.0
        out.append(RequestSample(cls="c", sent=t, scheduled=t, ttft_ms=ttft, e2e_ms=ttft + 50))
        t = round(t + every, 6)
    return out


SPEC = RecoverySpec.model_validate({"tolerance": "50%", "metrics": ["ttft_ms"],
                                    "window": "2s", "slack": "0ms"})
BASE = {"ttft_ms": 20.0}           # the limit: 30 ms
