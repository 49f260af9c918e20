"""Retries, as the seed manual prescribes them (``load.retries``):

* ``none`` (the default): one attempt per request;
* ``standard``: a 5xx answer or a connect error is retried at most twice with exponential
  backoff (100 ms, then 200 ms); a 429 once, after 100 ms or the server's ``Retry-After``
  (seconds form) if longer, capped at 30 s. Nothing else is retried (a timeout or a stream cut
  mid-way already cost the user the wait).

Every attempt is written as its own sample; the ones that were retried are counted apart
(``retried_attempts``), so a retry never hides a failure.
"""

from __future__ import annotations

import re

from streamquake.loadgen.samples import RequestSample

_RETRY_AFTER = re.compile(r"\(Retry-After: (\d+(?:\.\d+)?)\)")
_BACKOFF_S = 0.1
_MAX_RETRY_AFTER_S = 30.0


def retry_delay(policy: str, sample: RequestSample) -> float | None:
    """Seconds to wait before the next attempt, or None: this attempt is the last."""
    if policy != "standard" or sample.error is None:
        return None
    if sample.status == 429:
        if sample.attempt > 1:
            return None
        m = _RETRY_AFTER.search(sample.error_detail or "")
        wanted = float(m[1]) if m else 0.0
        return min(_MAX_RETRY_AFTER_S, max(_BACKOFF_S, wanted))
    server_error = sample.error == "http_status" and (sample.status or 0) >= 500
    if (server_error or sample.error == "connect") and sample.attempt <= 2:
        return float(_BACKOFF_S * 2 ** (sample.attempt - 1))
    return None
