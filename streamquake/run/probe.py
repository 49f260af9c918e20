"""One real streaming request per request class, before any load and before any fault: what a
TCP connect cannot tell (a 401, a 404 for a wrong path or model, an HTML page, a stream that never
yields a token). ``streamquake run`` does it after its parts start and stops with exit 3 when a
class cannot stream; ``streamquake probe`` does only this and prints what it saw.

The requests go through the load generator's own client (loadgen/client.py), so what the probe
says is what the load will meet; reasons are redacted as in samples. They are not samples: no
phase counts them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from streamquake.loadgen.samples import RequestSample
from streamquake.scenario import Scenario


@dataclass(frozen=True)
class Probed:
    cls: str
    sample: RequestSample

    @property
    def problem(self) -> str | None:
        """Why the load could not measure this class, or None."""
        s = self.sample
        if s.error is not None:
            return f"{s.error}: {s.error_detail or '(no reason given)'}"
        if s.content_events == 0:
            return ("the stream ended without one event of generated text: there is nothing "
                    "to time (is the prompt or max_tokens what the server expects?)")
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
    try:
        rng = random.Random(plan.seed)
        return [Probed(cls.name, client.measure(cls, rng)) for cls in plan.classes]
    finally:
        client.close()


def problems(probed: list[Probed]) -> list[str]:
    return [f"the probe before the load: {p.line()}" for p in probed if p.problem is not None]
