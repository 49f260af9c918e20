"""Folds one stream's events into its RequestSample as they arrive: times, gaps and stalls,
bursts, tool calls' arguments, and the protocol's end."""

from __future__ import annotations

import os

import gevent
import orjson

from streamquake.loadgen import self_measure
from streamquake.loadgen.failures import _Failed
from streamquake.loadgen.plan import LoadPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.sse_parser import SSEEvent
from streamquake.loadgen.stamps import _FIRST_BYTE, _TAKEN, _WRITTEN, _conn
from streamquake.loadgen.wire import (
    PlainTemplate,
    ProtocolError,
    decoder,
    ends_with_body,
    finish_required,
    plain_text,
    safety_finishes,
)
from streamquake.protocols import ToolDelta

# ``STREAMQUAKE_PLAIN_EVENTS=off`` in the load process's environment: every event goes through
# its protocol's ``decode`` and ``_Tally.add``, none through the shortcut for plain answer text
# (``add_plain``): benchmarks compare the two, and tests check they give the same samples.
PLAIN = os.environ.get("STREAMQUAKE_PLAIN_EVENTS", "on") != "off"

BURST_WAIT_MS = 50.0
"""A read that brings several content events this long or longer after the stream's previous
content (or, with the response headers, after the request) brought a burst: they were held back
on the way and released together, in lumps a reader sees (RequestSample.bunched). Events that
a fast server sends sub-millisecond apart share reads too, but after no such wait."""


_CALLS_MAX = 64             # tool calls one stream's checks follow
_CALL_ARGS_MAX = 1 << 20    # argument text kept per call; a longer one is not judged


class _ToolCall:
    """One tool call's arguments as they stream in, to say at the end whether they closed."""

    __slots__ = ("name", "pieces", "size", "deltas")

    def __init__(self) -> None:
        self.name: str | None = None
        self.pieces: list[str] = []
        self.size = 0
        self.deltas = 0

    def add(self, t: ToolDelta) -> None:
        if t.name is not None and self.name is None:
            self.name = t.name
        if t.piece:
            self.deltas += 1
            self.size += len(t.piece)
            if self.size <= _CALL_ARGS_MAX:
                self.pieces.append(t.piece)

    def check(self, finish: str | None) -> None:
        if not self.pieces or self.size > _CALL_ARGS_MAX:
            return              # no arguments streamed (the call takes none), or too long
        text = "".join(self.pieces)
        try:
            orjson.loads(text)
            return
        except orjson.JSONDecodeError as exc:
            at = exc.pos
        except ValueError:
            at = 0
        name = f" {self.name!r}" if self.name else ""
        why = f" (finish reason {finish!r})" if finish else ""
        if at >= len(text.rstrip()):    # it parsed to the end and wanted more
            raise _Failed("tool_call", f"a tool call{name} ended with its JSON arguments "
                                       f"unclosed after {self.deltas} argument deltas{why}: "
                                       "the answer stopped inside the call")
        # Whole but not JSON: argument chunks came twice, out of order, or garbled. The words
        # are the reason the reports group requests by (a few per kind): no quoted text, which
        # would make each request's reason its own.
        raise _Failed("tool_call", f"a tool call{name} ended with arguments that are not "
                                   f"valid JSON after {self.deltas} argument deltas{why}: "
                                   f"unexpected text at character {at}, as when a chunk is "
                                   "repeated, reordered or garbled on the way")


class _Tally:
    """Folds a stream's events into a RequestSample as they arrive.

    A gap over the stall threshold is the server's (``stalls``) only when the bytes really came
    that late: when the kernel's stamps say they came in time, or (without stamps) the gap less
    the time the gevent hub was running late within it is under the threshold, the stall was
    the load process's own and is counted apart (``client_stalls``). So is every such gap of a
    slow consumer (``paced``): its own pauses make them.
    """

    paced = False
    # The answer's text as received, kept for a conversation's turn only (the next turn sends
    # it back): a list to append to, or None to keep none.
    answer: list[str] | None = None

    def __init__(self, sample: RequestSample, plan: LoadPlan, t0: float,
                 max_events: int, guard: self_measure.Guard | None = None) -> None:
        self.sample = sample
        self.protocol = plan.protocol
        self._decode = decoder(plan.protocol)
        check = plain_text(plan.protocol) if PLAIN else None
        self._plain = None if check is None else PlainTemplate(check)
        self.finish_required = finish_required(plan.protocol)
        self.ends_with_body = ends_with_body(plan.protocol)
        self.safety_finishes = safety_finishes(plan.protocol)
        self.stall_s = plan.stall_threshold_ms / 1000.0
        self.t0 = t0
        self.guard = guard
        self.last_text_at: float | None = None
        self.last_text_seen = t0
        self.read_events = 0            # content events in the latest read that brought some
        self.read_held = False          # ... which came after a wait of BURST_WAIT_MS or more
        self.first_read_events = 0      # the first such read's, until a later one is a burst
        self.ids: set[int] = set()
        self.max_events = max_events
        self.events_left = max_events
        self.done = False
        self.headers_at: float | None = None    # the response's first byte (perf_counter s)
        self.calls: dict[str, _ToolCall] = {}   # tool calls by key, their arguments so far

    def first_byte(self, headers_seen: float) -> None:
        """TTFB: to the response's first byte, by the kernel's stamp of its read where there
        is one (``_StampedSocket.recv``), else to when the headers were seen (TLS)."""
        got = getattr(gevent.getcurrent(), _FIRST_BYTE, None)
        at = headers_seen if got is None or got is _TAKEN else min(got[0], headers_seen)
        self.headers_at = max(at, self.t0)     # never before the request's last byte written
        self.sample.ttfb_ms = (self.headers_at - self.t0) * 1000.0
        if self.guard is not None:
            # Bytes that waited unread share the newest one's stamp: while our hub was late,
            # the head's stamp may be a later segment's (RequestSample.head_lag_ms).
            self.sample.head_lag_ms = self.guard.blocked_within(self.t0, headers_seen) * 1000.0

    def complete(self) -> None:
        """The stream ended as its protocol says a complete one does: every tool call's
        arguments must be whole JSON by now (a call cut short inside them is an error)."""
        for call in self.calls.values():
            call.check(self.sample.finish_reason)
        self.done = True

    def _tools(self, tools: tuple[ToolDelta, ...]) -> None:
        for t in tools:
            if not t.key:
                continue        # a call sent whole (Gemini's functionCall): nothing to close
            call = self.calls.get(t.key)
            if call is None:
                if len(self.calls) >= _CALLS_MAX:
                    continue
                call = self.calls[t.key] = _ToolCall()
            call.add(t)

    def dated(self, t0: float) -> None:
        """Date the request from its last byte written, if this greenlet wrote it since the
        attempt began at ``t0``: TTFB, TTFT and E2E count from there, and the time before it
        (pool, connect, write) is ``send_ms``."""
        s = self.sample
        written = getattr(gevent.getcurrent(), _WRITTEN, None)
        if s.send_ms is not None or written is None or written < t0:
            return
        s.send_ms = (written - t0) * 1000.0
        s.sent += written - t0
        self.t0 = written
        if (conn := _conn()) is not None:
            conn.parts(s, written)

    def add(self, event: SSEEvent, now: float, seen: float | None = None,
            kernel: bool = False, with_headers: bool = False) -> None:
        """``now``: when the event's bytes arrived; ``seen``: when our code saw them (default:
        the same); ``kernel``: ``now`` is the kernel's receive stamp; ``with_headers``: the
        bytes came in the response headers' read."""
        s = self.sample
        seen = now if seen is None else seen
        self.events_left -= 1
        if self.events_left < 0:
            # Every event adds to the sample (an ITL, an id): a stream that never ends must
            # not grow the load process, or a sample line, without bound.
            raise _Failed("limit", f"more than {self.max_events:,} events in one stream "
                                   "(the client's event limit)")
        self._note_id(event.id)
        try:
            d = self._decode(event)
        except ProtocolError as exc:
            raise _Failed("protocol", str(exc)) from exc
        if d.usage_output_tokens is not None:
            s.usage_tokens = d.usage_output_tokens
        if d.usage_reasoning_tokens is not None:
            s.reasoning_tokens = d.usage_reasoning_tokens
        if d.response_id is not None and s.response_id is None:
            s.response_id = d.response_id
        if d.model is not None and s.model is None:
            s.model = d.model
        if d.finish is not None:
            s.finish_reason = d.finish
        tool_args = False
        if d.tools:
            self._tools(d.tools)
            tool_args = d.tool_args
        if d.text or d.reasoning or tool_args:
            # A content event: answer text, reasoning, or a tool call's arguments. TTFT and
            # ITL count them all (what the server generated); TTFA the answer's first.
            s.content_events += 1
            if (plain := self._plain) is not None and plain.size < 0 and d.text \
                    and s.content_events == 1:
                # The stream's template learns from its first answer text, read here: the
                # next read of such events is then folded whole (in C where the compiled
                # part is built: speedups.FramedStep), not read event by event to teach it.
                # Only the first: where it cannot learn from that one, add_plain goes on
                # trying, and events read here are not checked twice.
                plain(event.data.encode())
            if d.reasoning:
                s.reasoning_events += 1
            if tool_args:
                s.tool_events += 1
            if s.ttfa_ms is None and (d.text or tool_args):
                s.ttfa_ms = (now - self.t0) * 1000.0
            self._count_read(now, seen, with_headers)
            if self.last_text_at is None:
                s.ttft_ms = (now - self.t0) * 1000.0
            else:
                gap = now - self.last_text_at
                s.itl_ms.append(gap * 1000.0)
                if gap == 0.0:
                    s.shared_stamps += 1     # read with the one before: one stamp for both
                if gap > self.stall_s:
                    if kernel or self._server_late(gap, seen):
                        s.stalls += 1
                    else:
                        s.client_stalls += 1
                elif seen - self.last_text_seen > self.stall_s:
                    s.client_stalls += 1     # the bytes came in time; we saw them late
            self.last_text_at = now
            self.last_text_seen = seen
        if d.text and self.answer is not None:
            self.answer.append(d.text)
        if d.cache_n is not None:
            s.cache_n, s.prompt_n = d.cache_n, d.prompt_n
        if d.error is not None:
            # The server gave up mid-stream in its own words (e.g. Anthropic overloaded_error).
            raise _Failed("stream_error", f"error event in the stream: {d.error}")
        if d.finish is not None and d.finish in self.safety_finishes:
            raise _Failed("safety_stop", f"the answer was stopped by a safety filter (finish "
                                         f"reason {d.finish!r}) after {s.content_events} "
                                         "content events")
        if d.done:
            if self.finish_required and s.finish_reason is None:
                # llama-cpp-python's server ends a running answer this way when another
                # request waits: the tokens so far are not the answer asked for.
                raise _Failed("truncated", "the stream's final event came without a finish "
                                           "reason: the server ended the answer early")
            self.complete()

    def _note_id(self, eid: str | None) -> None:
        """An event's SSE id, counted when it is a sequence number (missing events: finish)."""
        if eid is not None and len(eid) <= 18 and eid.isdigit():
            self.ids.add(int(eid))

    def add_plain(self, events: list[tuple[bytes, str | None]], now: float, seen: float
                  ) -> bool:
        """One read's events, ``(data, id)`` each as ``SSEParser.plain`` gives them, folded
        in as :meth:`add` would fold them, when each is plain answer text
        (``WireProtocol.plain_text``) and the read needs none of add's rarer judgements: not
        the stream's first content, no stall, no event limit reached, no answer kept. A read
        after a wait long enough to be a burst is judged here as :meth:`_count_read` judges
        it event by event (a saturated load process's reads mostly come so). True if they
        were; False, with nothing changed, for :meth:`add` to read them one by one
        (``SSEEvent`` each, for ``add``)."""
        s = self.sample
        plain = self._plain
        gap = self._plain_gap(len(events), now, seen)
        if gap is None or plain is None:
            return False
        for data, _ in events:
            got = plain(data)
            if got is None or (got[0] is not None and s.response_id is None) \
                    or (got[1] is not None and s.model is None):
                return False
        for _, eid in events:
            self._note_id(eid)
        self._fold(len(events), gap, now, seen)
        return True

    def add_framed(self, n: int, eid: str | None, now: float, seen: float) -> bool:
        """:meth:`add_plain` of a read that is ``n`` events the stream's template vouched for
        whole (``PlainTemplate.framed``), each with the id ``eid`` (the parser's last): their
        data is not looked at, and no list of them is made. (The template's response id and
        model are the sample's already: it learns in :meth:`add`, from an event that sets
        them where the sample lacks them, or in :meth:`add_plain`, from an event that then
        goes to :meth:`add` where the sample lacks them.)"""
        gap = self._plain_gap(n, now, seen)
        if gap is None:
            return False
        self._note_id(eid)
        self._fold(n, gap, now, seen)
        return True

    def _plain_gap(self, n: int, now: float, seen: float) -> float | None:
        """The gap before a read of ``n`` plain events, where :meth:`add_plain` may fold them
        in (a template, content before, no stall, events left, no answer kept, not the first
        read of content); None where :meth:`add` must read them."""
        s = self.sample
        last = self.last_text_at
        if (self._plain is None or last is None or s.ttfa_ms is None or self.answer is not None
                or self.events_left < n):
            return None
        gap = now - last
        if gap > self.stall_s or seen - self.last_text_seen > self.stall_s:
            return None
        if s.content_reads + (now != last) <= 1:
            return None
        return gap

    def _fold(self, n: int, gap: float, now: float, seen: float) -> None:
        """As add does, event by event: ``n`` content events of one read, ``gap`` after the
        last content (0: the same read as it)."""
        s = self.sample
        self.events_left -= n
        s.content_events += n
        itl = s.itl_ms
        if now != self.last_text_at:
            s.content_reads += 1
            before = 0
            self.read_held = gap * 1000.0 >= BURST_WAIT_MS and self._held(gap, seen)
            itl.append(gap * 1000.0)
            shared = n - 1
        else:
            before = self.read_events
            shared = n
        self.read_events = after = before + n
        if self.read_held and after > 1:
            # _count_read's count, event by event: the read's second event makes it a burst
            # (with the first read's events, should they still wait to be counted), and every
            # event of it from there on is a burst's.
            if before < 2:
                s.burst_reads += 1
                s.burst_events += after + self.first_read_events
                self.first_read_events = 0
            else:
                s.burst_events += n
        if shared:
            itl.extend([0.0] * shared)      # read with the one before: one stamp for both
            s.shared_stamps += shared
        self.last_text_at = now
        self.last_text_seen = seen

    def _count_read(self, now: float, seen: float, with_headers: bool) -> None:
        """Count the reads that brought content, and the content events that came in bursts
        (BURST_WAIT_MS). The first read's wait is mostly the server's prompt processing: its
        events count as a burst when the response headers were held back with them, or once
        a later read is a burst (the stream is being held)."""
        s = self.sample
        if now != self.last_text_at:
            s.content_reads += 1
            self.read_events = 1
            if self.last_text_at is None:
                self.read_held = with_headers and self._held(now - self.t0, seen)
            else:
                self.read_held = self._held(now - self.last_text_at, seen)
        else:
            self.read_events += 1
        if s.content_reads == 1:
            if self.read_held:
                s.burst_reads += self.read_events == 1
                s.burst_events += 1
            else:
                self.first_read_events = self.read_events
        elif self.read_held and self.read_events > 1:
            new = self.read_events == 2
            s.burst_reads += new
            s.burst_events += (2 if new else 1) + self.first_read_events
            self.first_read_events = 0

    def _held(self, wait: float, seen: float) -> bool:
        """The read came ``wait`` after the one before (or the request) for reasons not ours:
        long enough, and neither our hub's lateness nor a slow consumer's pause."""
        if self.paced or wait * 1000.0 < BURST_WAIT_MS:
            return False
        blocked = 0.0 if self.guard is None else \
            self.guard.blocked_within(self.last_text_seen, seen)
        return (wait - blocked) * 1000.0 >= BURST_WAIT_MS

    def _server_late(self, gap: float, seen: float) -> bool:
        if self.paced:
            return False
        if self.guard is None:
            return True
        return gap - self.guard.blocked_within(self.last_text_seen, seen) > self.stall_s

    def silent(self, end: float) -> bool:
        """Content came, then none for longer than a stall up to ``end``: a hung answer."""
        return self.last_text_at is not None and end - self.last_text_at > self.stall_s

    def finish(self, end: float) -> RequestSample:
        s = self.sample
        s.e2e_ms = (end - self.t0) * 1000.0
        s.output_tokens = s.usage_tokens if s.usage_tokens is not None else s.content_events
        if self.ids:
            s.expected_events = max(self.ids)
            s.missing_events = s.expected_events - len(self.ids)
        return s
