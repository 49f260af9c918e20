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
    tool_args_delta,
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
    # Tool calls whose argument chunks after the first were dropped, first argument chunks sent
    # twice, and first two argument chunks swapped (``tool_call``: cut, duplicate, reorder).
    tool_calls_cut: int = 0
    tool_chunks_duplicated: int = 0
    tool_chunks_reordered: int = 0
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
        tool = self.spec.tool_call
        mode = tool.mode if tool is not None and rng.random() < tool.probability else None
        return FaultStream(self, rng, reset_after, error_after, tool_mode=mode)


@dataclass
class FaultStream:
    """One fault as one stream sees it."""

    fault: ActiveFault
    rng: random.Random
    reset_after: int | None
    error_after: int | None = None   # content events before this stream's error event
    contents: int = 0                # content events forwarded while this fault was on
    midway: bool = False             # met after the stream had begun
    tool_mode: str | None = None     # what this stream's tool call meets (``ToolCall.mode``)

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
        # ``tool_call``: the stream's first tool call (its key, once its first argument chunk
        # came), the fault that spoils it (None: none does), its argument chunks so far, and
        # the first chunk while ``reorder`` holds it back for the second.
        self._tool_key: str | None = None
        self._tool_fs: FaultStream | None = None
        self._tool_chunks = 0
        self.held: bytes | None = None
        self._held_by: FaultStream | None = None
        self._extra_events = 0      # events sent beyond the one ``count_forwarded`` is told of

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
                    fs.tool_mode = None
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
        out = self._decide(ev, raw, faults)
        if self.held is not None or self._tool_fs is not None or (
                faults and self._tool_key is None and any(fs.tool_mode for fs in faults)):
            out = self._tool_step(ev, out, faults)
        return out

    def _decide(self, ev: SSEEvent, raw: bytes, faults: list[FaultStream]) -> bytes | None:
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

    def _tool_step(self, ev: SSEEvent, out: bytes | None, faults: list[FaultStream]
                   ) -> bytes | None:
        """``tool_call``: spoil the stream's first tool call's argument chunks, one by one.

        Each is counted as the call's first chunk passes, its fate then set: so the count of a
        call met at a fault's end lands in that fault's record, not after it went off (a call
        of one chunk, with nothing after it to drop or swap, is counted though it comes whole).
        """
        held, self.held = self.held, None
        spoiler = (self._held_by if held is not None else self._tool_fs
                   or next((fs for fs in faults if fs.tool_mode), None))
        chunk = out is not None and spoiler is not None and self._tool_chunk(ev, spoiler)
        if held is not None:
            if out is None:
                return held     # the event was dropped: the held chunk goes in its place
            self._extra_events += 1
            if not chunk:       # no second chunk came: nothing to swap it with
                return held + out
            return out + held
        if not chunk or out is None or self._tool_fs is None:
            return out
        self._tool_chunks += 1
        fs, mode = self._tool_fs, self._tool_fs.tool_mode
        if mode == "cut":
            if self._tool_chunks == 1:
                self._tool_count(fs, "tool_calls_cut")
                return out
            return None
        self._tool_fs = None    # done with this call: its later chunks pass untouched
        if mode == "duplicate":
            self._tool_count(fs, "tool_chunks_duplicated")
            self._extra_events += 1
            return out + out
        if mode == "reorder":
            self._tool_count(fs, "tool_chunks_reordered")
            self.held, self._held_by = out, fs
            return None
        return out

    def _tool_chunk(self, ev: SSEEvent, spoiler: FaultStream) -> bool:
        """Whether ``ev`` is an argument chunk of the stream's first tool call (the first such
        chunk fixes which call that is, and that ``spoiler`` spoils it), in the format the
        fault names, else the one the request's path names."""
        if ev.data is None:
            return False
        spec = spoiler.fault.spec.tool_call
        if spec is not None and spec.protocol is not None:
            wire: protocols.WireProtocol | None = protocols.get(spec.protocol)
        else:
            if self._wire is False:
                self._wire = protocols.for_path(self.path)
            wire = self._wire if isinstance(self._wire, protocols.WireProtocol) else None
        if wire is None:
            return False
        delta = tool_args_delta(ev, wire)
        if delta is None:
            return False
        if self._tool_key is None:
            self._tool_key, self._tool_fs = delta.key, spoiler
        return delta.key == self._tool_key

    def _tool_count(self, fs: FaultStream | None, what: str) -> None:
        assert fs is not None
        for st in (fs.fault.stats, self.totals):
            setattr(st, what, getattr(st, what) + 1)

    @property
    def spoiling(self) -> bool:
        """A ``tool_call`` fault still has work on this stream (a chunk held, a call being cut),
        whether or not that fault is still on: the call's fate was set as it began."""
        return self.held is not None or self._tool_fs is not None

    def take_held(self) -> bytes:
        """A chunk ``reorder`` still holds when the stream ends (sent then, as it came)."""
        held, self.held = self.held or b"", None
        self._extra_events += bool(held)
        return held

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
        event_count = int(event) + self._extra_events   # a duplicate or a released chunk too
        self._extra_events = 0
        self.bytes += nbytes
        self.events += event_count
        for fs in faults:
            fs.fault.stats.bytes += nbytes
            fs.fault.stats.events_forwarded += event_count
        self.totals.bytes += nbytes
        self.totals.events_forwarded += event_count
