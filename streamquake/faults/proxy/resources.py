"""The proxy family's run-long part: the SSE fault proxy in front of the target.

It stands there for the whole run, faults or not, so that baseline and recovery are measured
through the same hop as the fault phase; faults are switched on and off through its control API.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from streamquake.faults.contract import JsonDict, RunContext, Wiring

if TYPE_CHECKING:
    from streamquake.faults.proxy.server import ProxyProcess

_STATS_TIMEOUT_S = 2.0


class FaultProxy:
    key = "sse_proxy"
    title = "the SSE fault proxy"
    stage: Literal["before_target", "after_target"] = "after_target"

    def __init__(self, *, insecure: bool = False) -> None:
        self.insecure = insecure
        self.process: ProxyProcess | None = None
        self.control_url: str | None = None
        self.control_key: str | None = None   # a private proxy's: its faults change only with it
        self.totals: JsonDict | None = None

    @classmethod
    def attached(cls, control_url: str) -> FaultProxy:
        """A proxy someone else started (tests, a hand-run proxy), known by its control URL."""
        proxy = cls()
        proxy.control_url = control_url
        return proxy

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        from streamquake.faults.proxy.server import start_proxy

        self.process = start_proxy(wiring.target_url, seed=ctx.seed, insecure=self.insecure,
                                   log_path=Path(ctx.run_dir) / "proxy.log", private=True)
        self.control_url = self.process.control_url
        self.control_key = self.process.key
        wiring.load_url = self.process.url

    def stop(self) -> None:
        if self.process is not None:
            if self.totals is None and self.process.proc.poll() is None:
                self.totals = self._read_totals()
            self.process.stop()

    def _read_totals(self) -> JsonDict | None:
        """The proxy's run-long counters (``upstream_retries``, ``proxy_errors``, ...)."""
        try:
            with urllib.request.urlopen(f"{self.control_url}/stats",
                                        timeout=_STATS_TIMEOUT_S) as resp:
                totals: JsonDict = json.loads(resp.read())["totals"]
                return totals
        except (OSError, ValueError, KeyError, TypeError):
            return None  # a proxy that died or hangs: the report goes without its counters

    def report(self) -> JsonDict | None:
        if self.process is None:
            return None
        out: JsonDict = {"url": self.process.url, "control_url": self.control_url}
        if self.totals is not None:
            out["totals"] = self.totals
            made = self.totals.get("proxy_errors")
            if isinstance(made, int) and made:
                out["warnings"] = [
                    f"the SSE proxy answered {made} request(s) itself (HTTP 502/504: it could "
                    "not reach the target, see run/proxy.log): they count as errors the target "
                    "never made"]
        return out
