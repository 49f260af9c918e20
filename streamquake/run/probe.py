"""One real streaming request per request class, before any load and before any fault: what a
TCP connect cannot tell (a 401, a 404 for a wrong path or model, an HTML page, a stream that never
yields a token). ``streamquake run`` does it after its parts start and stops with exit 3 when a
class cannot stream; ``streamquake probe`` does only this and prints what it saw.

The requests go through the load generator's own client (loadgen/client.py), so what the probe
says is what the load will meet; reasons are redacted as in samples. They are not samples: no
phase counts them.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from streamquake import protocols
from streamquake.errors import StreamquakeError
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.sse_parser import SSEEvent, SSELimitError, SSEParser
from streamquake.loadgen.templates import expand_headers, expand_path
from streamquake.loadgen.wire import build_request, join_path, protocol_headers
from streamquake.scenario import Scenario

# The second look at a stream whose events the format could not read: bounded in events,
# bytes and time (it only describes them).
_LOOK_EVENTS = 64
_LOOK_BYTES = 1 << 20
_LOOK_S = 15.0


@dataclass(frozen=True)
class Looked:
    """What a second request of the class carried, when the format read no text in the first:
    its events' shapes (``protocols.describe``, redacted) and the formats that do read them."""

    events: str
    readers: tuple[str, ...] = ()

    def text(self) -> str:
        if not self.readers:
            return f"its events looked like: {self.events}; {QUESTION}"
        names = " or ".join(f"`{n}`" for n in self.readers)
        return (f"its events looked like: {self.events}; they read as {names}: set "
                f"target.protocol: {self.readers[0]}")


QUESTION = "is target.protocol the format this server speaks at this path?"


def expected(protocol: protocols.Protocol, path: str | None) -> str:
    """What ``protocol`` reads as generated text, and where it asked: for a sentence that says
    the events were not that."""
    wire = protocols.get(protocol)
    return f"`{protocol}` at {path or wire.path('')} reads text from {wire.text_is}"


@dataclass(frozen=True)
class Probed:
    cls: str
    sample: RequestSample
    protocol: protocols.Protocol = "openai"
    path: str | None = None             # the scenario's target.path (None: the format's own)
    looked: Looked | None = None

    @property
    def problem(self) -> str | None:
        """Why the load could not measure this class, or None."""
        s = self.sample
        seen = self.looked.text() if self.looked is not None else None
        if s.error is not None:
            return f"{s.error}: {s.error_detail or '(no reason given)'}" + (
                f"; {seen}" if seen else "")
        if s.content_events == 0:
            # A protocol mismatch: the server answered and ended its stream as the format
            # ends one, and not one event carried text as the format reads it.
            return ("the stream ended without one event of generated text "
                    f"({expected(self.protocol, self.path)}): there is nothing to time; "
                    + (seen or QUESTION))
        return None

    def line(self) -> str:
        s = self.sample
        head = f"class {self.cls}: " + ("HTTP " + str(s.status) if s.status else "no answer")
        if self.problem is not None:
            return f"{head}; {self.problem}"
        parts = [f"first byte {s.ttfb_ms:.0f} ms" if s.ttfb_ms is not None else "",
                 f"first token {s.ttft_ms:.0f} ms" if s.ttft_ms is not None else "",
                 f"{s.content_events} content events",
                 f"{s.usage_tokens} tokens by usage" if s.usage_tokens is not None
                 else "no usage",
                 f"finish {s.finish_reason}" if s.finish_reason else "",
                 f"model {s.model}" if s.model else ""]
        return f"{head}; " + ", ".join(p for p in parts if p)


def probe(scenario: Scenario, base_url: str, work_dir: Path) -> list[Probed]:
    """One request per class of ``scenario`` to ``base_url``, one after another."""
    from streamquake.loadgen.client import StreamClient  # gevent: only where it is used
    from streamquake.run.load_from_scenario import load_plan_for

    plan = load_plan_for(scenario, base_url, work_dir / "probe", end_at=0.0)
    client = StreamClient(plan)
    out = []
    try:
        rng = random.Random(plan.seed)
        for cls in plan.classes:
            sample = client.measure(cls, rng)
            unread = sample.error == "protocol" or (sample.error is None
                                                    and sample.content_events == 0)
            out.append(Probed(cls.name, sample, plan.protocol, scenario.target.path,
                              look(plan, cls, client.redact) if unread else None))
    finally:
        client.close()
    return out


def look(plan: LoadPlan, cls: RequestClassPlan, redact: Callable[[str], str]) -> Looked | None:
    """One more request of ``cls``, read raw: the shapes of its events (redacted) and the
    formats that read them. None when it gets no event stream (the sample says why)."""
    try:
        headers = {**protocol_headers(plan.protocol), "Accept-Encoding": "identity",
                   **expand_headers(plan.headers, os.environ)}
        path = expand_path(plan.path, os.environ) if plan.path else None
        route, body = build_request(plan.protocol, plan.model, cls, random.Random(plan.seed),
                                    path)
        events = _events(plan, join_path(urlsplit(plan.base_url).path, path or route),
                         json.dumps(body).encode(), headers)
    except (OSError, http.client.HTTPException, StreamquakeError, SSELimitError):
        return None
    if events is None:
        return None
    found = protocols.readers(events, (protocols.get(n) for n in protocols.names()
                                       if n != plan.protocol))
    return Looked(redact(protocols.describe(events)), tuple(found))


def _events(plan: LoadPlan, uri: str, payload: bytes,
            headers: dict[str, str]) -> list[SSEEvent] | None:
    url = urlsplit(plan.base_url)
    host, port = url.hostname or "", url.port
    timeout = min(plan.timeout_s, _LOOK_S)
    conn: http.client.HTTPConnection
    if url.scheme == "https":
        ctx = ssl.create_default_context()
        if not plan.verify_tls:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", uri, body=payload, headers=headers)
        resp = conn.getresponse()
        if not 200 <= resp.status < 300 or "text/event-stream" not in (
                resp.getheader("Content-Type") or "").lower():
            return None
        parser, taken = SSEParser(), 0
        events: list[SSEEvent] = []
        deadline = time.monotonic() + timeout
        while len(events) < _LOOK_EVENTS and taken < _LOOK_BYTES and time.monotonic() < deadline:
            chunk = resp.read1(1 << 16)
            if not chunk:
                break
            taken += len(chunk)
            events += parser.feed(chunk)
        return events[:_LOOK_EVENTS]
    finally:
        conn.close()


def problems(probed: list[Probed]) -> list[str]:
    return [f"the probe before the load: {p.line()}" for p in probed if p.problem is not None]
