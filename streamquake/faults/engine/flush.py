"""The cache flush: erase the engine's slots once as the fault is applied, then, with ``every``,
again on that period until it is reverted, one thread per slot (an erase of a busy slot waits
for the slot, and must not hold the others back).

The threads live in the process that applied the fault (the run, or the agent holding it) and
are daemons: a SIGKILL of that process ends the flushing with it, so a journal entry left by a
killed run has nothing to undo, and ``recover`` says so. A flush itself cannot be undone: the
engine refills its cache as requests come. Revert stops the flushing and reports what it did.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from streamquake.errors import InjectorError
from streamquake.faults.contract import JsonDict, JsonValue, RunContext
from streamquake.faults.engine import slots as api
from streamquake.faults.engine.address import target_base
from streamquake.faults.engine.spec import CacheFlushFault
from streamquake.journal import JournalEntry

# How long revert waits for a slot's thread past its call's own timeout.
_JOIN_SLACK_S = 2.0
UNDONE = ("a flush cannot be undone (the engine refills its cache as requests come); revert "
          "stops the flushing")


@dataclass
class Tally:
    """What the flushing did, shared by the slots' threads."""

    sent: int = 0
    erased: int = 0
    tokens: int = 0
    skipped: int = 0                 # ticks a slot missed while its erase waited on the engine
    failures: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n_erased: int | None, reason: str | None) -> None:
        with self.lock:
            self.sent += 1
            if reason is None:
                self.erased += 1
                self.tokens += n_erased or 0
            else:
                self.failures[reason] += 1

    def read(self) -> JsonDict:
        with self.lock:
            return {"erases_sent": self.sent, "erased": self.erased,
                    "erases_failed": sum(self.failures.values()),
                    "failures": dict(self.failures), "tokens_erased": self.tokens,
                    "ticks_skipped": self.skipped}


def base_url(spec: CacheFlushFault, ctx: RunContext) -> str:
    if spec.url is not None:
        return spec.url
    return target_base(ctx, spec.label, "cache_flush", "no engine to flush",
                       "http://127.0.0.1:8080")


class CacheFlushInjector:
    """Flushes one engine's KV cache through its slots API for the fault's window."""

    type_name = "cache_flush"

    def __init__(self, spec: CacheFlushFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.timeout_s = spec.timeout_ms / 1000
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tally = Tally()
        self._flushes = 0            # rounds begun: the first at apply, then one per period
        self._slots: list[int] = []
        self._applied = False

    @property
    def _base(self) -> str:
        return base_url(self.spec, self.ctx)

    def preflight(self) -> list[str]:
        try:
            base = self._base
            listed = api.slot_ids(base, self.timeout_s)
            missing = self._missing(listed)
            if missing:
                return [missing]
            refusal = api.erase_refusal(base, self._wanted(listed)[0], self.timeout_s)
        except InjectorError as exc:
            return [str(exc)]
        return [refusal] if refusal else []

    def _missing(self, listed: list[int]) -> str | None:
        if self.spec.slots == "all":
            return None
        absent = [s for s in self.spec.slots if s not in listed]
        if not absent:
            return None
        return (f"slot(s) {', '.join(map(str, absent))} not on the engine at {self._base}: it "
                f"has slots {', '.join(map(str, listed))}; list those in `slots`, or write all")

    def _wanted(self, listed: list[int]) -> list[int]:
        return listed if self.spec.slots == "all" else list(self.spec.slots)

    def apply(self, entry: JournalEntry) -> JsonDict:
        base = self._base
        where = urllib.parse.urlsplit(base).netloc
        # One run's flushes of one engine add up; another owner's would muddle this one's steps.
        entry.claim({f"engine:{where}:slots": f"the KV cache of the engine at {where}"},
                    per_owner=True)
        listed = api.slot_ids(base, self.timeout_s)
        missing = self._missing(listed)
        if missing:
            raise InjectorError(f"cannot apply fault '{self.spec.label}': {missing}")
        self._slots = self._wanted(listed)
        # What `recover` reads: nothing to undo, and whose process the flushing lived in.
        entry.save({"url": base, "slots": list(self._slots), "every_ms": self.spec.every_ms,
                    "pid": os.getpid()})
        self._applied = True
        first = self._flush_once(base)
        if first.erased == 0:
            reasons = "; ".join(f"{n} x {r}" for r, n in first.failures.items())
            raise InjectorError(f"cannot apply fault '{self.spec.label}': no slot of the engine "
                                f"at {base} was erased ({reasons})")
        if self.spec.every_ms is not None:
            start = time.monotonic()
            for slot in self._slots:
                t = threading.Thread(target=self._slot_loop, args=(base, slot, start),
                                     name=f"cache-flush-{slot}", daemon=True)
                self._threads.append(t)
                t.start()
        return {"url": base, "slots": list(self._slots), "every_ms": self.spec.every_ms,
                "first_flush": {"erased": first.erased, "tokens_erased": first.tokens,
                                "failures": dict(first.failures)}}

    def _flush_once(self, base: str) -> Tally:
        """Every slot erased at once (each waits only for its own slot); counted in the run's
        tally too."""
        round_tally = Tally()

        def one(slot: int) -> None:
            n, reason = self._erase(base, slot)
            round_tally.add(n, reason)

        self._flushes += 1
        with ThreadPoolExecutor(max_workers=len(self._slots)) as pool:
            list(pool.map(one, self._slots))
        return round_tally

    def _erase(self, base: str, slot: int) -> tuple[int | None, str | None]:
        try:
            n, reason = api.erase(base, slot, self.timeout_s), None
        except api.EraseFailed as exc:
            n, reason = None, exc.reason
        self._tally.add(n, reason)
        return n, reason

    def _slot_loop(self, base: str, slot: int, start: float) -> None:
        assert self.spec.every_ms is not None
        period = self.spec.every_ms / 1000
        tick = 1
        while not self._stop.wait(max(0.0, start + tick * period - time.monotonic())):
            self._erase(base, slot)
            due = int((time.monotonic() - start) / period)
            missed = max(0, due - tick)
            with self._tally.lock:
                self._tally.skipped += missed
                if slot == self._slots[0]:
                    self._flushes += 1
            tick += 1 + missed

    def revert(self) -> JsonDict:
        self._stop.set()
        deadline = time.monotonic() + self.timeout_s + _JOIN_SLACK_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        running = [t.name for t in self._threads if t.is_alive()]
        out: JsonDict = {"flushing": "stopped" if self._applied else "never started",
                         "flushes": self._flushes, **self._tally.read(), "note": UNDONE}
        if running:
            # Each ends after its call's own timeout, and with the process in any case.
            out["ending"] = list[JsonValue](running)
        return out

    def describe(self) -> JsonDict:
        try:
            url: str | None = self._base
        except InjectorError:
            url = None
        return {"type": self.type_name, "name": self.spec.label, "phase": self.spec.phase,
                "url": url, "slots": self.spec.slots if self.spec.slots == "all" else
                list(self.spec.slots), "every_ms": self.spec.every_ms,
                "timeout_ms": self.spec.timeout_ms}

    @classmethod
    def recover(cls, state: dict[str, object]) -> str:
        url, pid = state.get("url"), state.get("pid")
        if not isinstance(url, str):
            return "nothing to undo: the fault never flushed an engine"
        return (f"nothing to undo at {url}: {UNDONE}, and its flushing ended with the process "
                f"that ran it (pid {pid})")
