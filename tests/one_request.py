"""One request through the real streaming client (``StreamClient.measure``, as a load process
sends it), outside any run: what the tests of wire formats, answer parts and proxy faults read
one sample at a time."""

from __future__ import annotations

import random

from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample


def measure(base_url: str, protocol: str, path: str | None = None, *,
            cls: RequestClassPlan | None = None, prompt: str = "say something",
            max_tokens: int = 8, timeout_s: float = 20.0, model: str = "m-1",
            headers: dict[str, str] | None = None,
            environ: dict[str, str] | None = None) -> RequestSample:
    """One request of ``cls`` (else ``prompt`` with ``max_tokens``) to ``base_url`` in
    ``protocol`` (at ``path``, else the format's own), and its sample."""
    fields: dict[str, object] = {
        "base_url": base_url, "protocol": protocol, "samples_path": "/nonexistent",
        "end_at": 0.0, "timeout_s": timeout_s, "connect_timeout_s": 5.0, "model": model,
        "headers": headers or {}}
    if path is not None:
        fields["path"] = path
    client = StreamClient(LoadPlan.model_validate(fields), environ=environ)
    try:
        return client.measure(cls or RequestClassPlan(prompts=[prompt], max_tokens=max_tokens),
                              random.Random(0))
    finally:
        client.close()
