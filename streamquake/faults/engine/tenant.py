"""The noisy tenant: another tenant's long requests against the target for the fault's window,
``concurrency`` streams held open at once (closed loop) or ``rate`` new ones a second (at most
``concurrency`` open), each built by the scenario's wire format (``streamquake.protocols``).

Its streams are threads of the process that applied the fault (the run, or the agent holding
it), daemons, and its requests go straight from that process to the target: the load generator
never sees them, so they are no sample of the scenario's. A SIGKILL of that process ends them
with it (the kernel closes its sockets, the target sees its clients gone), so a journal entry
left by a killed run has nothing to undo, and ``recover`` says so. Revert stops the sending and
closes the open streams at once, and reports what the tenant did.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from streamquake.envref import ENV_REF
from streamquake.errors import InjectorError
from streamquake.faults.contract import (
    JsonDict,
    JsonValue,
    Resource,
    RunContext,
    ScenarioView,
    Wiring,
)
from streamquake.faults.engine import streams
from streamquake.faults.engine.address import target_base
from streamquake.faults.engine.spec import NoisyTenantFault
from streamquake.journal import JournalEntry
from streamquake.protocols import get

_JOIN_S = 2.0                # revert's wait for the streams' threads once their sockets are shut
_BACKOFF_S = (0.05, 1.0)     # a failing stream waits from the first to the second, doubling
# A sentence of words, repeated to the prompt's length: counted as one token a word, as the
# embedded target counts them.
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a",
          "noisy", "tenant", "reads")


@dataclass
class ScenarioTarget:
    """The scenario's target as the noisy tenant asks it by default: its format, model, path
    and headers, and (once the run's target is up) its address, straight, not through any
    proxy of the run's. A run-long resource that does nothing but remember."""

    protocol: str
    model: str
    path: str | None
    headers: Mapping[str, str]
    verify_tls: bool
    url: str = ""
    key: str = "engine-noisy-tenant-target"
    title: str = "a note of the target's address for the noisy tenant (nothing runs)"
    stage: Literal["before_target", "after_target"] = "after_target"

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        self.url = wiring.target_url

    def stop(self) -> None:
        pass

    def report(self) -> JsonDict | None:
        return None


def resources(scenario: ScenarioView) -> list[Resource]:
    if not any(f.type == "noisy_tenant" for f in scenario.faults):
        return []
    t = scenario.target
    view = ScenarioTarget(t.protocol, t.model, t.path, dict(t.headers), t.verify_tls)
    return [view]


def _expand(text: str, what: str) -> str:
    def one(m: re.Match[str]) -> str:
        value = os.environ.get(m[1])
        if value is None:
            raise InjectorError(f"{what} names ${{{m[1]}}}, which is not set in this "
                                "environment: set it")
        return value
    return ENV_REF.sub(one, text)


def prompt_of(words: int) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


class NoisyTenantInjector:
    """Sends another tenant's long streams to the target for the fault's window."""

    type_name = "noisy_tenant"

    def __init__(self, spec: NoisyTenantFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.timeout_s = spec.timeout_ms / 1000
        self._tally = streams.Tally()
        self._stop = threading.Event()
        self._opened = streams.Opened()
        self._threads: list[threading.Thread] = []
        self._next_at = 0.0
        self._started = 0.0
        self._ran_s = 0.0
        self._applied = False

    # -- what it sends -------------------------------------------------------------------------

    def request(self, prompt_tokens: int | None = None,
                max_tokens: int | None = None) -> streams.Request:
        """The tenant's request (``prompt_tokens`` and ``max_tokens``: its spec's, unless
        given, as preflight's short one)."""
        spec, view = self.spec, self.ctx.find(ScenarioTarget)
        protocol = spec.protocol or (view.protocol if view else None)
        if protocol is None:
            raise InjectorError(f"fault '{spec.label}' (noisy_tenant) has no wire format to "
                                "send: give its `protocol` (e.g. openai)")
        fmt = get(protocol)
        model = spec.model or (view.model if view else None) or "sim-1"
        base = spec.url or (view.url if view and view.url else None) or self._ctx_base()
        if spec.path is not None:
            path = written = spec.path
        elif view is not None and view.path is not None and protocol == view.protocol:
            written = view.path
            path = _expand(view.path, "the scenario's target.path")
        else:
            path = written = fmt.path(model)
        headers = dict(fmt.headers())
        if view is not None and spec.url is None:
            for name, value in view.headers.items():
                headers[name] = _expand(value, f"the scenario's target header {name!r}")
        body = fmt.body_for(path, model, prompt_of(prompt_tokens or spec.prompt_tokens),
                            max_tokens or spec.max_tokens)
        verify = view.verify_tls if view is not None else True
        return streams.Request(base + path, fmt, json.dumps(body).encode(), headers, verify,
                               self.timeout_s, shown=base + written)

    def _ctx_base(self) -> str:
        return target_base(self.ctx, self.spec.label, "noisy_tenant", "no target to send to",
                           "http://127.0.0.1:8000")

    # -- the contract --------------------------------------------------------------------------

    def preflight(self) -> list[str]:
        """The target answers one short request of the tenant's format with a stream (200): a
        request of 1 token, its head read and the stream left."""
        try:
            req = self.request(prompt_tokens=1, max_tokens=1)
        except InjectorError as exc:
            return [str(exc)]
        try:
            answer = streams.ask_once(req)
        except streams.NO_ANSWER as exc:
            return [f"cannot reach the target at {req.shown} "
                    f"({streams.reason_of(exc, req.timeout_s)}): its requests would all "
                    "fail; check the target is up, or give the fault's `url`"]
        if answer.status != 200:
            return [f"the target at {req.shown} refused the tenant's {req.fmt.name} request: "
                    f"HTTP {answer.status} ({answer.message}); give the fault the `protocol` "
                    "and `path` the target serves"]
        return []

    def apply(self, entry: JournalEntry) -> JsonDict:
        req = self.request()
        # One run's tenants on one target add up; another owner's would muddle this one's steps.
        entry.claim({f"engine:{req.where}:noisy_tenant": f"the extra load on {req.where}"},
                    per_owner=True)
        # What `recover` reads: nothing to undo, and whose process the streams lived in.
        entry.save({"url": req.shown, "concurrency": self.spec.concurrency, "pid": os.getpid()})
        self._applied = True
        self._stop = threading.Event()
        self._opened = streams.Opened()
        self._started = self._next_at = time.monotonic()
        stop, opened = self._stop, self._opened
        for i in range(self.spec.concurrency):
            t = threading.Thread(target=self._loop, args=(req, stop, opened),
                                 name=f"noisy-tenant-{i}", daemon=True)
            self._threads.append(t)
            t.start()
        return {"url": req.shown, "protocol": req.fmt.name, "concurrency": self.spec.concurrency,
                "rate_per_s": self.spec.rate_per_s, "prompt_tokens": self.spec.prompt_tokens,
                "max_tokens": self.spec.max_tokens, "pid": os.getpid()}

    def _loop(self, req: streams.Request, stop: threading.Event,
              opened: streams.Opened) -> None:
        backoff = _BACKOFF_S[0]
        while self._arrival(stop):
            if streams.stream_once(req, self._tally, opened):
                backoff = _BACKOFF_S[0]
            elif stop.wait(backoff):
                return
            else:
                backoff = min(_BACKOFF_S[1], backoff * 2)

    def _arrival(self, stop: threading.Event) -> bool:
        """Wait for this stream's next request (at once, without ``rate``); False once
        stopped. Arrivals due while every stream was busy are skipped and counted."""
        if self.spec.rate_per_s is None:
            return not stop.is_set()
        period = 1.0 / self.spec.rate_per_s
        with self._tally.lock:
            now = time.monotonic()
            at = self._next_at
            late = int((now - at) / period)
            if late > 0:
                self._tally.skipped += late
                at += late * period
            self._next_at = at + period
        return not stop.wait(max(0.0, at - now))

    def revert(self) -> JsonDict:
        self._stop.set()
        was_open = self._opened.close()
        deadline = time.monotonic() + _JOIN_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._applied and self._started:
            self._ran_s += time.monotonic() - self._started
            self._started = 0.0
        running = [t.name for t in self._threads if t.is_alive()]
        self._threads = [t for t in self._threads if t.is_alive()]
        out: JsonDict = {"load": "stopped" if self._applied else "never started",
                         "open_at_revert": was_open, "ran_s": round(self._ran_s, 3),
                         **self._tally.read()}
        if running:
            # Each ends within its socket's timeout, and with the process in any case.
            out["ending"] = list[JsonValue](running)
        return out

    def describe(self) -> JsonDict:
        try:
            url: str | None = self.request().shown
        except InjectorError:
            url = None
        s = self.spec
        return {"type": self.type_name, "name": s.label, "phase": s.phase, "url": url,
                "concurrency": s.concurrency, "rate_per_s": s.rate_per_s,
                "prompt_tokens": s.prompt_tokens, "max_tokens": s.max_tokens,
                "protocol": s.protocol, "timeout_ms": s.timeout_ms}

    @classmethod
    def recover(cls, state: dict[str, object]) -> str:
        url, pid = state.get("url"), state.get("pid")
        if not isinstance(url, str):
            return "nothing to undo: the noisy tenant never sent a request"
        return (f"nothing to undo at {url}: the noisy tenant's streams were threads of the "
                f"process that ran it (pid {pid}) and ended with it (its sockets closed)")
