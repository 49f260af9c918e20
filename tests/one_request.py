"""One request through the real streaming client (``StreamClient.measure``, as a load process
sends it), outside any run: what the tests of wire formats, answer parts and proxy faults read
one sample at a time; and an embedded target behind a real SSE proxy driven through its control
API, for the tests of the proxy's faults."""

from __future__ import annotations

import contextlib
import json
import random
import urllib.request
from collections.abc import Iterator
from typing import Any

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.faults.proxy.server import ProxyProcess, start_proxy
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


@contextlib.contextmanager
def proxied_target(embedded: dict[str, object]) -> Iterator[ProxyProcess]:
    """An embedded target with ``embedded``'s settings behind a real SSE proxy, both processes
    of their own, stopped after."""
    with start_target(TargetConfig.model_validate(embedded)) as target, \
            start_proxy(target.url) as proxy:
        yield proxy


def control(proxy: ProxyProcess, method: str, path: str, body: Any = None) -> Any:
    """A call to the proxy's control API (``PUT /faults/NAME`` with a fault's settings,
    ``DELETE`` it for its counts); its JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(proxy.control_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())
