"""The shortcut for plain answer text (``SSEParser.plain``, ``WireProtocol.plain_text``,
``_Tally.add_plain``, and for reads of the stream's template, ``PlainTemplate.framed`` and
``_Tally.add_framed``) against the event-by-event path (``SSEParser.feed``, ``decode``,
``_Tally.add``) it stands in for: the same reads, at the same times, into two streams, one
with the shortcut and one without, must leave the same sample, tally and parser after every
read, and end or fail the same way. Streams are the embedded target's own OpenAI encoder's
events, with every kind of event it sends and the odd ones real servers send, cut into reads
anywhere; then real streams over loopback, with the shortcut on and off.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamquake.loadgen.client import _Stream
from streamquake.loadgen.failures import _Failed, _StreamTimeout
from streamquake.loadgen.plan import LoadPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.sse_parser import SSEEvent, SSELimitError, SSELimits, SSEParser
from streamquake.loadgen.tally import BURST_WAIT_MS, _Tally
from streamquake.loadgen.wire import PlainTemplate
from streamquake.protocols.base import Completion, GenRequest
from streamquake.protocols.openai import OpenAI, OpenAIEncoder
from tests.test_client import start_server

STALL_MS = 250.0
REPO = Path(__file__).resolve().parent.parent


@dataclass
class _Arrival:
    """What ``_Stream.chunk`` reads of a read's arrival (``stamps.Arrival``'s fields)."""

    at: float
    seen: float
    kernel: bool = True
    with_headers: bool = False


def _stream(plain: bool, max_events: int) -> tuple[_Stream, _Tally, _Arrival]:
    plan = LoadPlan(base_url="http://127.0.0.1:9", protocol="openai", samples_path="/tmp",
                    end_at=time.time() + 60, stall_threshold_ms=STALL_MS)
    sample = RequestSample(cls="c", sent=0.0, scheduled=None, trace_id="t", span_id="s")
    tally = _Tally(sample, plan, 100.0, max_events)
    if not plain:
        tally._plain = None
    assert (tally._plain is not None) == plain
    arrival = _Arrival(100.0, 100.0)
    return _Stream(None, tally, SSEParser(SSELimits()), arrival, 1e9, None), tally, arrival  # type: ignore[arg-type]


def _state(stream: _Stream, tally: _Tally) -> dict[str, Any]:
    p = stream.parser
    return {"sample": tally.sample.to_json(), "ids": sorted(tally.ids),
            "tally": (tally.last_text_at, tally.last_text_seen, tally.read_events,
                      tally.read_held, tally.first_read_events, tally.events_left, tally.done),
            "stream": (stream.last_events, stream.kernel_reads, stream.user_reads),
            "parser": (p._last_id, p.pending, p._skip_lf, p._bom_checked)}


def _feed(stream: _Stream, data: bytes) -> tuple[str, object]:
    try:
        return "ok", stream.chunk(data)
    except _Failed as exc:
        return "failed", (exc.kind, exc.detail)
    except (SSELimitError, _StreamTimeout) as exc:
        return type(exc).__name__, str(exc)


_Pair = tuple[_Stream, _Tally, _Arrival]


def _read_both(fast: _Pair, slow: _Pair, i: int, data: bytes) -> tuple[str, object]:
    """The ``i``-th read, arrived and seen ``0.01 (i + 1)`` s after the request, by both paths:
    the same answer, and the same sample, tally and parser after it."""
    fast[2].at = slow[2].at = fast[2].seen = slow[2].seen = 100.0 + 0.01 * (i + 1)
    got = _feed(fast[0], data)
    assert got == _feed(slow[0], data), data
    assert _state(fast[0], fast[1]) == _state(slow[0], slow[1]), data
    return got


def _encoder(ids: bool, crlf: bool) -> OpenAIEncoder:
    enc = OpenAIEncoder(GenRequest(model="sim-1", prompt_tokens=5, max_tokens=None,
                                   include_usage=True), ids)
    if crlf:
        enc._eol = b"\r\n"      # type: ignore[misc]
    return enc


# What a stream may hold besides plain tokens: the encoder's own kinds, and the odd events real
# servers send (comments, event names, a usage-only chunk, two choices, a split data line...).
_ODD = [
    b": keep-alive\n\n",
    b"event: message\ndata: {\"id\":\"x\",\"model\":\"m\",\"choices\":[{\"index\":0,"
    b"\"delta\":{\"content\":\"e\"},\"finish_reason\":null}]}\n\n",
    b"data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\n",
    b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"a\"}},{\"delta\":"
    b"{\"content\":\"b\"}}]}\n\n",
    b"data: {\"id\":\"x\",\n data: \"choices\":[{\"delta\":{\"content\":\"s\"}}]}\n\n",
    b"data: {\"id\":\"y\",\"model\":\"other\",\"choices\":[{\"delta\":{\"content\":\"o\"}}]}\n\n",
    b"data: {\"choices\":[{\"delta\":{\"content\":\"no id\"}}]}\n\n",
    b"data: {\"choices\":[{\"delta\":{\"content\":\"\"}}]}\n\n",
    b"data: {\"choices\":[{\"delta\":{\"content\":\"r\",\"reasoning\":\"t\"}}]}\n\n",
    b"data: {\"choices\":[{\"text\":\"legacy\"}]}\n\n",
    b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"timings\":{\"cache_n\":2,"
    b"\"prompt_n\":3}}\n\n",
    b"id: 77\ndata: {\"choices\":[{\"delta\":{\"content\":\"i\"}}]}\n\n",
    b"id: \ndata: {\"choices\":[{\"delta\":{\"content\":\"i\"}}]}\n\n",
    b"data: not json\n\n",
    b"data: {\"choices\":[{\"delta\":{\"content\":\"\xff\xfe\"}}]}\n\n",
    b"data: {\"error\":{\"message\":\"overloaded\"}}\n\n",
    b"retry: 10\n\n",
    b"\n\n",
]


def cut_reads(draw: st.DrawFn, events: list[bytes], whole: int, cuts_max: int,
              lead: bytes = b"") -> list[bytes]:
    """A stream's body (``lead``, then its events) in reads: mostly whole events (as a fast
    server's writes fall; an event's end, counted without ``lead``, is a read's end unless a
    draw of 0..``whole`` gives 0), and up to ``cuts_max`` cuts anywhere."""
    body = lead + b"".join(events)
    cuts: set[int] = set()
    at = 0
    for e in events:
        at += len(e)
        if draw(st.integers(0, whole)):
            cuts.add(at)
    cuts |= set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=cuts_max)))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(body)), len(body)]
    return [body[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], list[tuple[float, float]], int, bool]:
    ids, crlf = draw(st.booleans()), draw(st.booleans())
    enc = _encoder(ids, crlf)
    events = [enc.opening()]
    kinds = draw(st.lists(st.sampled_from(["token"] * 12 + ["reasoning", "tool", "odd"]),
                          min_size=1, max_size=40))
    n = 0
    for i, kind in enumerate(kinds):
        text = b'"tok%d"' % i
        if kind == "token":
            events.append(enc.token(text))
        elif kind == "reasoning":
            events.append(enc.reasoning(text))
        elif kind == "tool":
            events.append(enc.tool_args(text, n == 0, False))
            n += 1
        else:
            events.append(draw(st.sampled_from(_ODD)))
    if draw(st.booleans()):
        events.append(enc.closing(Completion(len(kinds), False)))
    bom = b"\xef\xbb\xbf" if draw(st.booleans()) else b""
    reads = cut_reads(draw, events, 3, 6, bom)
    # Each read's arrival gap (ms): shared stamps, the usual, a burst's wait, a stall; and
    # how late our code saw it.
    times = []
    t = 100.0
    for _ in reads:
        t += draw(st.sampled_from([0.0, 0.0, 0.0005, 0.02, 0.049, 0.06, 0.3]))
        times.append((t, t + draw(st.sampled_from([0.0, 0.0001, 0.3]))))
    return reads, times, draw(st.sampled_from([5, 30, 10_000])), crlf


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_the_shortcut_leaves_what_the_event_by_event_path_leaves(
        case: tuple[list[bytes], list[tuple[float, float]], int, bool]) -> None:
    reads, times, max_events, _ = case
    fast, fast_tally, fast_arrival = _stream(True, max_events)
    slow, slow_tally, slow_arrival = _stream(False, max_events)
    for data, (at, seen) in zip(reads, times, strict=True):
        fast_arrival.at = slow_arrival.at = at
        fast_arrival.seen = slow_arrival.seen = seen
        got = _feed(fast, data)
        assert got == _feed(slow, data), data
        assert _state(fast, fast_tally) == _state(slow, slow_tally), data
        if got[0] != "ok" or got[1] is not None:
            break


# Read times (s after the request) that each call on one of the rarer judgements: a held
# read (a burst) whose events go on under the same stamp (the shortcut judges it as add
# does), a stall, a read seen late (the client's own stall), a stream past its event limit
# (these three are left to add).
@pytest.mark.parametrize(("times", "seen_late", "max_events", "expected"), [
    ([0.01, 0.02, 0.03, 0.09, 0.09, 0.09], 0.0, 1000, (4, 0, 0, None)),
    ([0.01, 0.02, 0.4, 0.41, 0.41, 0.42], 0.0, 1000, (0, 1, 0, None)),
    ([0.01, 0.02, 0.03, 0.04, 0.05, 0.06], 0.3, 1000, (0, 0, 1, None)),
    ([0.01, 0.02, 0.03, 0.04, 0.05, 0.06], 0.0, 4, (0, 0, 0, "limit")),
])
def test_the_shortcut_leaves_the_rare_judgements_to_add(
        times: list[float], seen_late: float, max_events: int,
        expected: tuple[int, int, int, str | None]) -> None:
    enc = _encoder(False, False)
    fast, fast_tally, fast_arrival = _stream(True, max_events)
    slow, slow_tally, slow_arrival = _stream(False, max_events)
    failed = None
    for i, t in enumerate(times):
        data = enc.token(b'"t%d"' % i)
        fast_arrival.at = slow_arrival.at = 100.0 + t
        fast_arrival.seen = slow_arrival.seen = 100.0 + t + (seen_late if i == 3 else 0.0)
        got = _feed(fast, data)
        assert got == _feed(slow, data)
        assert _state(fast, fast_tally) == _state(slow, slow_tally)
        if got[0] == "failed":
            failed = got[1][0]      # type: ignore[index]
            break
    s = fast_tally.sample
    assert (s.burst_events, s.stalls, s.client_stalls, failed) == expected


def _record(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, into: list[Any]) -> None:
    """``cls.name`` still runs, and what each call returns is appended to ``into``."""
    method = getattr(cls, name)

    def recorded(self: object, *args: Any) -> Any:
        got = method(self, *args)
        into.append(got)
        return got
    monkeypatch.setattr(cls, name, recorded)


def test_plain_streams_take_the_shortcut_for_every_read_but_the_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It must be used, or it saves nothing: every read after the first content of an
    ordinary stream, with ids or without, one event a read or several, each after the usual
    wait or after one long enough to be a burst (as a saturated load process reads)."""
    taken: list[bool] = []
    _record(monkeypatch, _Tally, "add_plain", taken)
    _record(monkeypatch, _Tally, "add_framed", taken)
    framed_reads: list[int] = []
    _record(monkeypatch, PlainTemplate, "framed", framed_reads)
    for ids, per_read, wait in itertools.product((False, True), (1, 3), (0.01, 0.06)):
        taken.clear()
        framed_reads.clear()
        enc = _encoder(ids, False)
        stream, tally, arrival = _stream(True, 10_000)
        events = [enc.token(b'"t%d"' % i) for i in range(30)]
        reads = [b"".join(events[i:i + per_read]) for i in range(0, 30, per_read)]
        for i, data in enumerate(reads):
            arrival.at = arrival.seen = 100.0 + wait * (i + 1)
            assert stream.chunk(data) is None
        end = arrival.at = arrival.seen = 100.0 + wait * (len(reads) + 1)
        assert stream.chunk(enc.closing(Completion(30, False))) == end
        # The first read (the role chunk, and the first token: TTFT) is the parser's
        # first, which looks for a byte order mark: feed's. Every other read went through
        # the shortcut, but for the closing events.
        assert taken == [True] * (len(reads) - 1) + [False]
        # With no id: from the second read on (the first's first token taught the template),
        # each read's events are known by their bytes alone, one or several.
        assert [k for k, _ in framed_reads if k] == \
            ([] if ids else [per_read] * (len(reads) - 1))
        s = tally.sample
        assert (s.content_events, len(s.itl_ms), s.finish_reason, s.usage_tokens) == \
            (30, 29, "stop", 30)
        assert s.shared_stamps == 30 - len(reads)
        assert tally.ids == (set(range(1, enc._seq + 1)) if ids else set())
        # After a burst's wait, every read of several events is a burst, and so, once
        # the second read is, are the first read's events.
        held = wait >= BURST_WAIT_MS / 1000.0 and per_read > 1
        assert (s.burst_reads, s.burst_events) == ((len(reads) - 1, 30) if held else (0, 0))


@pytest.mark.parametrize("after", [
    "closing",                                       # the stream's end, read with its last text
    b'data: {"choices":[{"delta":{"content":"no id"}}]}\n\n',    # text of another shape
    b"id: 9\n\n",                                   # an id the next events inherit
    "cut",                                           # the next event's first bytes
])
def test_a_reads_run_of_template_events_is_folded_before_its_other_events(
        after: bytes | str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that begins with events of the stream's template and goes on with others (a
    saturated load process reads the last tokens with the closing events): the run is folded
    in whole, and the rest read as any read is; both paths leave the same sample, tally and
    parser after each read, and end the same way."""
    folded: list[int] = []
    add_framed = _Tally.add_framed

    def recorded(self: _Tally, n: int, *args: Any) -> bool:
        took = add_framed(self, n, *args)
        folded.append(n if took else 0)
        return took
    monkeypatch.setattr(_Tally, "add_framed", recorded)
    enc = _encoder(False, False)
    fast, slow = _stream(True, 1000), _stream(False, 1000)
    reads = [enc.token(b'"t%d"' % i) for i in range(4)]
    run = b"".join(enc.token(b'"u%d"' % i) for i in range(3))
    last = enc.token(b'"v"')
    rest = (enc.closing(Completion(8, False)) if after == "closing" else
            last[:9] if after == "cut" else after)
    assert isinstance(rest, bytes)
    reads += [run + rest]
    if after == "cut":
        reads.append(last[9:])
    elif after != "closing":
        reads += [last, enc.closing(Completion(9, False))]
    ends = [_read_both(fast, slow, i, data) for i, data in enumerate(reads)]
    # The reads of one token after the first (whose token taught the template), then the
    # mixed read's run of three; after an id, a read of one more (text of another shape
    # teaches the template its own bytes, so the next token is read by add_plain, which
    # learns them back).
    assert folded == [1, 1, 1, 3] + ([1] if after == b"id: 9\n\n" else [])
    if after == "closing":
        assert ends[-1] == ("ok", 100.0 + 0.01 * len(reads))


@pytest.mark.parametrize("before", [
    b'data: {"id":',            # a line cut short: the parser holds it
    "whole but for its end",    # an event's line whose blank line has not come
    b"retry: 5\n",              # a field of an event still open
])
def test_a_read_that_looks_like_the_template_waits_for_what_the_parser_holds(
        before: bytes | str) -> None:
    """A read that is, by its bytes alone, one event of the stream's template is still not
    one when the parser holds part of an event from the reads before: both paths must leave
    the same sample, and end the same way."""
    enc = _encoder(False, False)
    fast, slow = _stream(True, 1000), _stream(False, 1000)
    reads = [enc.token(b'"t%d"' % i) for i in range(4)]
    template_read = enc.token(b'"next"')
    reads.append(template_read[:-1] if isinstance(before, str) else before)
    reads.append(template_read)
    for i, data in enumerate(reads):
        _read_both(fast, slow, i, data)
    template = fast[1]._plain
    assert template is not None and template.framed(template_read)[0]


@pytest.mark.parametrize("between", [
    # An id with no event: the template's events after it carry it, though none names it.
    b"id: 9\n\n",
    # Content with no response id nor model, between the template's events.
    b'data: {"choices":[{"delta":{"content":"no id"}}]}\n\n',
])
def test_reads_of_the_template_are_folded_as_their_events_would_be(between: bytes) -> None:
    """Reads of one and of several events of the stream's template, with what may change
    how they fold between them (an id they inherit, content of another shape): both paths
    leave the same sample, tally and parser after each read."""
    enc = _encoder(False, False)
    fast, slow = _stream(True, 1000), _stream(False, 1000)
    reads = [*[enc.token(b'"t%d"' % i) for i in range(3)], between,
             *[enc.token(b'"t%d"' % i) for i in range(3, 5)], between,
             *[b"".join(enc.token(b'"u%d"' % (3 * i + j)) for j in range(3)) for i in range(3)]]
    framed = 0
    for i, data in enumerate(reads):
        template = fast[1]._plain
        framed += template is not None and template.framed(data)[0] > 0
        _read_both(fast, slow, i, data)
    assert framed >= 4      # the shortcut was there to take, reads of one event and of three


def test_plain_text_vouches_only_for_what_decode_reads_as_text_alone() -> None:
    wire = OpenAI()
    enc = _encoder(False, False)
    token = enc.token(b'"hi"')
    role, plain = token.split(b"\n\n")[:2]
    assert wire.plain_text(plain[6:]) == (enc.response_id, "sim-1", "hi")
    for odd in [role, *_ODD]:
        for line in odd.split(b"\n"):
            if line.startswith(b"data: ") and (got := wire.plain_text(line[6:])) is not None:
                d = wire.decode(SSEEvent(data=line[6:].decode()))
                assert d.text == got[2]
                assert d.text and not (d.reasoning or d.tools or d.finish or d.done
                                       or d.error or d.usage_output_tokens is not None
                                       or d.cache_n is not None), line
    assert wire.plain_text(b"[DONE]") is None


def _payloads(raw: bytes) -> list[bytes]:
    """The JSON data of each event in ``raw``."""
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]


def _learned(enc: OpenAIEncoder | None = None) -> tuple[PlainTemplate, list[bytes], bytes]:
    """A template that has learned from one plain event of a stream (whose data it returns),
    and the list its check records the data of each event it was asked about in."""
    wire = OpenAI()
    asked: list[bytes] = []

    def check(data: bytes) -> tuple[str | None, str | None, str] | None:
        asked.append(data)
        return wire.plain_text(data)
    template = PlainTemplate(check)
    data = _payloads((enc or _encoder(False, False)).token(b'"hi there"'))[-1]
    assert template(data) == (wire.plain_text(data) or ())[:2] != ()
    assert asked == [data] and template.size > 0
    return template, asked, data


@settings(max_examples=400, deadline=None)
@given(middle=st.one_of(st.binary(max_size=12), st.text(max_size=8).map(str.encode),
                        st.from_regex(rb"[ -~]{1,8}", fullmatch=True)))
def test_the_stream_template_answers_as_the_check_for_any_text_bytes(middle: bytes) -> None:
    """Whatever bytes stand where the learned event's text stood (a quote, a backslash, an
    escape, a control or non-ASCII byte, nothing at all), the template answers what the
    protocol's own check answers of the whole event."""
    template, asked, data = _learned()
    head, _, tail = data.partition(b"hi there")
    event = head + middle + tail
    got = OpenAI().plain_text(event)
    assert template(event) == (None if got is None else got[:2]), event
    # The same event as a whole read, alone or three times over: the template knows it by
    # its bytes only when the parser would read it as these events, with no id, and the check
    # vouches for each.
    parser = SSEParser(SSELimits())
    parser.feed(b": opened\n\n")
    for k in (1, 3):
        read = (b"data: " + event + b"\n\n") * k
        count, end = template.framed(read)
        assert (count, end) == template.framed_py(read)  # compiled or not, the same answer
        if count:
            assert parser.plain(read) == [(event, None)] * k == [(event, None)] * count
            assert end == len(read)
            assert got is not None, read
        else:
            assert end == 0
            assert not middle or any(c < 0x20 or c > 0x7e or c in b'"\\' for c in middle)
        # Cut short, its last event is not one; run on, what follows is not: the whole events
        # before are, and end where they end.
        one = len(read) // k
        for other, whole in ((read[:-1], k - 1), (read + b"d", k), (read + read[:-1], 2 * k - 1)):
            assert template.framed(other) == template.framed_py(other)
            assert template.framed(other) == ((whole, whole * one) if count else (0, 0)), other


def test_the_stream_template_parses_only_what_differs_from_the_learned_event() -> None:
    enc = _encoder(False, False)
    template, asked, data = _learned(enc)
    [hit] = _payloads(enc.token(b'" word!"'))
    assert template(hit) == (enc.response_id, "sim-1") and asked[1:] == []
    # Not the same bytes around the text: each goes to the check (and the last one, plain
    # text that is not verbatim, teaches nothing).
    others = [enc.reasoning(b'"r"'), enc.tool_args(b'"{}"', True, False),
              enc.closing(Completion(3, False)), enc.token(b'"caf\\u00e9"'),
              enc.token(b'"say \\"hi\\""')]
    for raw in others:
        for event in _payloads(raw):
            got = OpenAI().plain_text(event)
            assert template(event) == (None if got is None else got[:2])
            assert asked[-1] == event
    assert template(hit) == (enc.response_id, "sim-1") and asked[-1] != hit
    # Text that appears twice in the event (here: also as the model's name) teaches nothing.
    asked.clear()
    fresh = PlainTemplate(template.check)
    twice = data.replace(b'"hi there"', b'"sim-1"')
    assert fresh(twice) == (enc.response_id, "sim-1")
    assert fresh(twice) == (enc.response_id, "sim-1") and asked == [twice, twice]
    assert fresh.size < 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from start_server(tmp_path_factory.mktemp("sse"))


# Each way in a fresh load process of its own, the switch read from its environment as
# ``streamquake run``'s load processes read it (the streams of this one are read by an
# interpreter that has run nothing else).
_READ_STREAMS = """
import json, sys
from tests.test_shared_reader import essence, run_streams
samples = run_streams(sys.argv[1], json.loads(sys.argv[2]))
print(json.dumps([[list(essence(s)), s.stalls, s.response_id] for s in samples]))
"""


@pytest.mark.timeout(120)
def test_real_streams_read_the_same_with_the_shortcut_and_without(server: str) -> None:
    paths = ["/s?n=40&gap_ms=2", "/s?n=12&skip=4,7", "/s?n=8&gap_ms=2&stall=5:400",
             "/s?n=6&gap_ms=30&garbage=3", "/s?n=20&gap_ms=3&eol=crlf"]

    def read(plain: str) -> list[Any]:
        done = subprocess.run([sys.executable, "-c", _READ_STREAMS, server, json.dumps(paths)],
                              cwd=REPO, capture_output=True, text=True, timeout=100,
                              env={**os.environ, "STREAMQUAKE_PLAIN_EVENTS": plain})
        assert done.returncode == 0, done.stderr[-3000:]
        got: list[Any] = json.loads(done.stdout)
        return got

    on, off = read("on"), read("off")
    assert on == off
    assert [s[0][0] for s in on] == [None, None, None, "protocol", None]     # the errors
    assert on[2][1] == 1                                                     # one stall
