"""The proxy's fault decisions: per-stream fault state, what each event and stream meets, and
the counters of what was done.

Nothing here touches the network: the server (``proxy_server.py``) asks a ``StreamFaults``
what to do with each event and when a stream must end, and does it.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from streamquake import protocols
from streamquake.faults.proxy.framing import (
    SSEEvent,
    corrupt_event,
    is_content_event,
    is_usage_event,
)
from streamquake.faults.proxy.spec import SSEProxyFault


@dataclass
class Stats:
    """What the proxy did; per fault, and in total (each action counted once there).

    Per fault, ``requests``/``events_seen``/``content_events``/``events_forwarded``/``bytes``
    count what passed while the fault was active, so ``events_dropped / content_events`` is the
    drop rate injected and ``first_event_delays`` the streams whose first event it held back.
    """

    requests: int = 0
    events_seen: int = 0
    content_events: int = 0
    events_forwarded: int = 0
    events_dropped: int = 0
    events_delayed: int = 0
    delay_ms_total: float = 0.0
    first_event_delays: int = 0
    stalls: int = 0
    truncations: int = 0
    aborts_by_status: dict[str, int] = field(default_factory=dict)
    resets: int = 0
    corruptions: int = 0
    # Streams ended with their format's mid-stream error event (``error_event``).
    error_events: int = 0
    # Streams held open with nothing more sent (``stop_after``), and those whose client then
    # gave up (closed the connection) while held.
    hangs: int = 0
    hangs_ended_by_client: int = 0
    usage_dropped: int = 0      # usage-only events dropped (``drop_usage``)
    upstream_errors: int = 0
    # Errors the proxy answered itself (502/504; injected ones are not counted here), and
    # requests sent again on a fresh connection after a pooled one was found closed.
    proxy_errors: int = 0
    upstream_retries: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["delay_ms_total"] = round(self.delay_ms_total, 3)
        return out


@dataclass(eq=False)
class ActiveFault:
    name: str
    spec: SSEProxyFault
    seed: int
    stats: Stats = field(default_factory=Stats)
    streams: int = 0
    delays: bool = field(init=False)
    since: float = field(default_factory=time.monotonic)    # when it was put on

    def __post_init__(self) -> None:
        spec = self.spec
        # Whether it can add time to an event: the others skip that part of each event.
        self.delays = (spec.first_event_delay_ms is not None or spec.delay_ms is not None
                       or spec.stall is not None)

    def open_stream(self) -> FaultStream:
        # One generator per (seed, fault, stream number): a replay makes the same choices.
        rng = random.Random(f"{self.seed}:{self.name}:{self.streams}")
        self.streams += 1
        self.stats.requests += 1
        reset = self.spec.reset
        reset_after = error_after = None
        if reset is not None and rng.random() < reset.probability:
            reset_after = reset.after_events
        error = self.spec.error_event
        if error is not None and rng.random() < error.probability:
            error_after = error.after
        return FaultStream(self, rng, reset_after, error_after)


@dataclass
class FaultStream:
    """One fault as one stream sees it."""

    fault: ActiveFault
    rng: random.Random
    reset_after: int | None
    error_after: int | None = None   # content events before this stream's error event
    contents: int = 0                # content events forwarded while this fault was on
    midway: bool = False             # met after the stream had begun

    def roll(self, probability: float | None) -> bool:
        return probability is not None and self.rng.random() < probability


# What a stream does after an event: go on, end cleanly, end with a TCP reset, end with its
# format's error event (``StreamFaults.error_bytes``) and then cleanly, or hang (send nothing
# more, hold the connection open until the client closes it).
CONTINUE, END, RESET, ERROR, HANG = "continue", "end", "reset", "error", "hang"


class StreamFaults:
    """Per-request fault bookkeeping: the faults met so far, what was forwarded, the lag.

    ``active`` is the proxy's live table of faults, read afresh at each event, so a fault switched
    on mid-stream applies from the next event on; ``totals`` counts across all faults.
    """

    def __init__(self, active: dict[str, ActiveFault], totals: Stats, path: str = "") -> None:
        self._active = active
        self.path = path
        self._wire: protocols.WireProtocol | None | bool = False   # False: not looked up yet
        self.totals = totals
        self._mine: dict[ActiveFault, FaultStream] = {}
        self.events = 0
        self.bytes = 0
        self.lag_s = 0.0
        self.first = True
        self.opened = time.monotonic()
        self.erred: FaultStream | None = None    # the fault whose error event ends the stream
        self.hung: FaultStream | None = None      # the fault that holds the stream open

    def faults(self) -> list[FaultStream]:
        active = self._active
        if not active:
            return []
        out = []
        for af in active.values():
            fs = self._mine.get(af)
            if fs is None:
                fs = self._mine[af] = af.open_stream()
                if self.opened < af.since:
                    # Met mid-stream: an error or a hang is the answer's fate from its start,
                    # so a stream begun before the fault (in the phase before) never gets one.
                    fs.error_after = None
                    fs.midway = True
            out.append(fs)
        return out

    def abort_status(self, faults: list[FaultStream]) -> tuple[int, str | None, str] | None:
        for fs in faults:
            abort = fs.fault.spec.abort
            if abort is not None and fs.roll(abort.probability):
                key = str(abort.status)
                for st in (fs.fault.stats, self.totals):
                    st.aborts_by_status[key] = st.aborts_by_status.get(key, 0) + 1
                return abort.status, abort.retry_after_header(), fs.fault.name
        return None

    def decide(self, ev: SSEEvent, raw: bytes, faults: list[FaultStream]) -> bytes | None:
        """Apply per-event faults: the bytes to send, or None to drop the event."""
        totals = self.totals
        totals.events_seen += 1
        content = bool(faults) and is_content_event(ev)
        for fs in faults:
            fs.fault.stats.events_seen += 1
            fs.fault.stats.content_events += content
        totals.content_events += content
        if not content and self._usage_dropped(ev, faults):
            return None
        if content:
            dropped = False
            for fs in faults:  # every fault rolls, in order: a replay makes the same choices
                if fs.roll(fs.fault.spec.drop):
                    fs.fault.stats.events_dropped += 1
                    dropped = True
            if dropped:
                totals.events_dropped += 1
                return None
            for fs in faults:
                fs.contents += 1
        added_s = 0.0
        for fs in faults:
            if fs.fault.delays:
                added_s += self._delays(fs)
        if added_s > 0:
            self.lag_s += added_s
            totals.delay_ms_total += added_s * 1000.0
        self.first = False
        if content:
            corrupted = False
            for fs in faults:
                if fs.roll(fs.fault.spec.corrupt):
                    fs.fault.stats.corruptions += 1
                    corrupted = True
            if corrupted:
                totals.corruptions += 1
                raw = corrupt_event(raw)
        return raw

    def _usage_dropped(self, ev: SSEEvent, faults: list[FaultStream]) -> bool:
        droppers = [fs for fs in faults if fs.fault.spec.drop_usage]
        if not droppers:
            return False
        if self._wire is False:
            self._wire = protocols.for_path(self.path)
        wire = self._wire
        if not isinstance(wire, protocols.WireProtocol) or not is_usage_event(ev, wire):
            return False
        for fs in droppers:
            fs.fault.stats.usage_dropped += 1
        self.totals.usage_dropped += 1
        return True

    def _delays(self, fs: FaultStream) -> float:
        spec, st, totals = fs.fault.spec, fs.fault.stats, self.totals
        added_ms = 0.0
        if self.first and spec.first_event_delay_ms is not None:
            added_ms += spec.first_event_delay_ms
            st.first_event_delays += 1
            totals.first_event_delays += 1
        if spec.delay_ms is not None and fs.roll(spec.delay_probability):
            jitter = spec.delay_jitter_ms or 0.0
            added_ms += max(0.0, spec.delay_ms + fs.rng.uniform(-jitter, jitter))
            st.events_delayed += 1
            totals.events_delayed += 1
        if spec.stall is not None and fs.roll(spec.stall.probability):
            added_ms += spec.stall.duration_ms
            st.stalls += 1
            totals.stalls += 1
        st.delay_ms_total += added_ms
        return added_ms / 1000.0

    def byte_budget(self, faults: list[FaultStream]) -> int | None:
        budget = None
        for fs in faults:
            limit = fs.fault.spec.truncate_after_bytes
            if limit is not None and (budget is None or limit - self.bytes < budget):
                budget = limit - self.bytes
        return budget

    def limits_reached(self, faults: list[FaultStream]) -> str:
        """After each event (and at the start): has a truncation or a reset come due?"""
        for fs in faults:
            if fs.reset_after is not None and self.events >= fs.reset_after:
                fs.fault.stats.resets += 1
                self.totals.resets += 1
                return RESET
        for fs in faults:
            if fs.error_after is not None and fs.contents >= fs.error_after:
                fs.fault.stats.error_events += 1
                self.totals.error_events += 1
                self.erred = fs
                return ERROR
        for fs in faults:
            stop = fs.fault.spec.stop_after
            if stop is not None and not fs.midway and fs.contents >= stop:
                fs.fault.stats.hangs += 1
                self.totals.hangs += 1
                self.hung = fs
                return HANG
        outcome = CONTINUE
        for fs in faults:
            if self._truncate_due(fs):
                fs.fault.stats.truncations += 1
                outcome = END
        if outcome == END:
            self.totals.truncations += 1
        return outcome

    def error_bytes(self, path: str) -> bytes:
        """The error event that ends this stream (after ``limits_reached`` said ERROR), in the
        fault's format, else the one whose endpoint ``path`` names, else a generic one."""
        assert self.erred is not None
        spec = self.erred.fault.spec.error_event
        assert spec is not None
        wire = (protocols.get(spec.protocol) if spec.protocol is not None
                else protocols.for_path(path) or protocols.get("sse"))
        return wire.error_event(spec.message)

    def hang_ended_by_client(self) -> None:
        assert self.hung is not None
        self.hung.fault.stats.hangs_ended_by_client += 1
        self.totals.hangs_ended_by_client += 1

    def _truncate_due(self, fs: FaultStream) -> bool:
        spec = fs.fault.spec
        return (spec.truncate_after_events is not None and self.events >= spec.truncate_after_events
                ) or (spec.truncate_after_bytes is not None
                      and self.bytes >= spec.truncate_after_bytes)

    def pass_through(self, nbytes: int, events: int) -> None:
        """Counts what went out while no fault was active, as ``decide`` and ``count_forwarded``
        would have, event by event."""
        self.bytes += nbytes
        self.events += events
        self.first = self.first and not events
        totals = self.totals
        totals.events_seen += events
        totals.events_forwarded += events
        totals.bytes += nbytes

    def count_forwarded(self, faults: list[FaultStream], nbytes: int, event: bool) -> None:
        self.bytes += nbytes
        self.events += event
        for fs in faults:
            fs.fault.stats.bytes += nbytes
            fs.fault.stats.events_forwarded += event
        self.totals.bytes += nbytes
        self.totals.events_forwarded += event
