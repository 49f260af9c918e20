"""Conformance of the incremental SSE parser with the WHATWG event-stream interpretation.

Every case is fed whole, byte by byte, and split at every single position, because a parser
that passes on whole buffers can still break on the read boundaries a socket produces.
"""

from __future__ import annotations

import pytest

from streamquake.loadgen.sse_parser import SSEEvent, SSELimitError, SSELimits, SSEParser
from tests.timing import cpu_s

E = SSEEvent

CASES: dict[str, tuple[bytes, list[SSEEvent]]] = {
    # The four examples of the spec's "Parsing an event stream" section.
    "spec-multiline-data": (b"data: YHOO\ndata: +2\ndata: 10\n\n", [E(data="YHOO\n+2\n10")]),
    "spec-ids-and-comment": (
        b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n"
        b"data:  third event\n\n",
        [E(data="first event", id="1"), E(data="second event"), E(data=" third event")],
    ),
    "spec-empty-data": (b"data\n\ndata\ndata\n\ndata:", [E(data=""), E(data="\n")]),
    "spec-space-after-colon": (b"data:test\n\ndata: test\n\n", [E(data="test"), E(data="test")]),
    # Line ends.
    "cr-only": (b"data: a\rdata: b\r\r", [E(data="a\nb")]),
    "crlf": (b"data: a\r\ndata: b\r\n\r\n", [E(data="a\nb")]),
    "mixed-line-ends": (b"data: a\r\ndata: b\rdata: c\n\r\n", [E(data="a\nb\nc")]),
    "lf-cr-is-two-line-ends": (b"data: a\n\r", [E(data="a")]),
    # Fields.
    "event-type": (b"event: add\ndata: 73857293\n\n", [E(event="add", data="73857293")]),
    "empty-event-type-is-message": (b"event:\ndata: x\n\n", [E(data="x")]),
    "event-type-reset-after-dispatch": (
        b"event: a\ndata: 1\n\ndata: 2\n\n", [E(event="a", data="1"), E(data="2")]),
    "event-type-reset-by-empty-block": (b"event: a\n\ndata: 2\n\n", [E(data="2")]),
    "id-persists": (b"id: 5\ndata: a\n\ndata: b\n\n", [E(data="a", id="5"), E(data="b", id="5")]),
    "id-with-nul-ignored": (
        b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n", [E(data="a", id="1"), E(data="b", id="1")]),
    "id-set-without-data-applies-later": (b"id: 7\n\ndata: a\n\n", [E(data="a", id="7")]),
    "retry": (b"retry: 1000\ndata: a\n\n", [E(data="a", retry=1000)]),
    "retry-not-digits-ignored": (b"retry: 10a\ndata: a\n\nretry\ndata: b\n\n",
                                 [E(data="a"), E(data="b")]),
    "comments": (b": hi\ndata: a\n:again\n\n", [E(data="a")]),
    "unknown-field-ignored": (b"foo: bar\ndata: a\n\n", [E(data="a")]),
    "space-before-colon-is-part-of-name": (b"data : x\ndata: y\n\n", [E(data="y")]),
    "only-one-space-removed": (b"data:  two\n\n", [E(data=" two")]),
    "colon-in-value": (b"data: a:b\n\n", [E(data="a:b")]),
    "empty-data-value-dispatches": (b"data:\n\n", [E(data="")]),
    "no-dispatch-without-data": (b"event: x\nid: 3\n\n\n\n", []),
    "unterminated-event-discarded": (b"data: a\n\ndata: b\n", [E(data="a")]),
    "nul-in-data-kept": (b"data: a\x00b\n\n", [E(data="a\x00b")]),
    # Encoding.
    "bom-stripped": (b"\xef\xbb\xbfdata: a\n\n", [E(data="a")]),
    "second-bom-kept": (b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n", [E(data="b")]),
    "utf8-multibyte": (b"data: \xe2\x82\xac \xf0\x9f\x98\x80\n\n", [E(data="\u20ac \U0001f600")]),
    "invalid-utf8-replaced": (b"data: \xff\xe2\x82\n\n", [E(data="\ufffd\ufffd")]),
}


def _parse_in_pieces(pieces: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.close())
    return events


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", list(CASES))
def test_conformance_whole_and_byte_by_byte(name: str) -> None:
    stream, expected = CASES[name]
    assert _parse_in_pieces([stream]) == expected
    assert _parse_in_pieces([stream[i:i + 1] for i in range(len(stream))]) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", list(CASES))
def test_conformance_every_split_point(name: str) -> None:
    stream, expected = CASES[name]
    for cut in range(len(stream) + 1):
        assert _parse_in_pieces([stream[:cut], stream[cut:]]) == expected, f"cut at {cut}"


def _event_by_event(stream: bytes) -> list[bytes]:
    """``stream`` cut after each blank line (LF LF), as a client that keeps up reads an LLM
    stream: one event a read."""
    pieces = stream.split(b"\n\n")
    return [p + b"\n\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", list(CASES))
def test_conformance_event_by_event(name: str) -> None:
    stream, expected = CASES[name]
    assert _parse_in_pieces(_event_by_event(stream)) == expected
    # After any of them, in the same parser: what was held, persisted or reset carries over.
    follow = b"data: {\"x\": 1}\n\n"
    for tail in ([follow], [follow, follow]):
        whole = _parse_in_pieces([stream + b"".join(tail)])
        assert _parse_in_pieces(_event_by_event(stream) + tail) == whole


@pytest.mark.timeout(10)
def test_a_whole_event_a_read_after_each_kind_of_held_state() -> None:
    event = b'data: {"choices":[{"delta":{"content":"\xe2\x82\xac"}}]}\n\n'
    parser = SSEParser()
    assert parser.feed(event) == [E(data='{"choices":[{"delta":{"content":"\u20ac"}}]}')]
    # With an id persisted, an event type or a retry held, a CR pending, or a partial line
    # held, the next whole event comes out as the spec says.
    assert parser.feed(b"id: 9\n") == []
    assert parser.feed(b"data: a\n\n") == [E(data="a", id="9")]
    assert parser.feed(b"event: e\n") == []
    assert parser.feed(b"data: b\n\n") == [E(event="e", data="b", id="9")]
    assert parser.feed(b"retry: 5\n") == []
    assert parser.feed(b"data: c\n\n") == [E(data="c", id="9", retry=5)]
    assert parser.feed(b"data: d\r") == []
    assert parser.feed(b"\ndata: e\n\n") == [E(data="d\ne", id="9")]
    assert parser.feed(b"da") == []
    assert parser.feed(b"data: f\n\n") == []             # the line "dadata: f": unknown field
    assert parser.feed(b"data: g\n\n") == [E(data="g", id="9")]
    # A lone CR inside is a line end: the data line "a", then an unknown field "b".
    assert parser.feed(b"data: a\rb\n\n") == [E(data="a", id="9")]
    # A first read may open with a byte order mark.
    fresh = SSEParser()
    assert fresh.feed(b"\xef\xbb\xbfdata: h\n\n") == [E(data="h")]
    # Its limits hold too.
    small = SSEParser(SSELimits(max_line_bytes=64, max_event_bytes=16))
    assert small.feed(b": opened\n") == []
    assert small.feed(b"data: " + b"x" * 16 + b"\n\n") == [E(data="x" * 16)]
    with pytest.raises(SSELimitError) as err:
        small.feed(b"data: " + b"x" * 17 + b"\n\n")
    assert err.value.kind == "event"


@pytest.mark.timeout(10)
def test_cr_ending_a_read_dispatches_at_once_and_pairs_with_next_lf() -> None:
    parser = SSEParser()
    # The event is complete the moment its CR arrives: a timing client must see it now.
    assert parser.feed(b"data: a\r\r") == [E(data="a")]
    assert parser.feed(b"\ndata: b\r\n\r\n") == [E(data="b")]
    assert not parser.pending


@pytest.mark.timeout(10)
def test_events_come_out_of_the_read_that_completes_them() -> None:
    parser = SSEParser()
    assert parser.feed(b"id: 1\ndata: {\"a\"") == []
    assert parser.pending
    assert parser.feed(b":1}\n") == []
    events = parser.feed(b"\nid: 2\ndata: x\n\nid")
    assert events == [E(data='{"a":1}', id="1"), E(data="x", id="2")]
    assert parser.pending
    assert parser.close() == []
    assert not parser.pending


@pytest.mark.timeout(10)
def test_close_resets_for_a_new_stream() -> None:
    parser = SSEParser()
    parser.feed(b"\xef\xbb\xbfid: 4\ndata: half")
    parser.close()
    # A new stream may start with its own BOM, and does not inherit the old last event ID.
    assert parser.feed(b"\xef\xbb\xbfdata: new\n\n") == [E(data="new")]


# Limits ---------------------------------------------------------------------------------------

SMALL = SSELimits(max_line_bytes=16, max_event_bytes=24, max_data_lines=4)


def _feed_all(stream: bytes, pieces: int, limits: SSELimits = SMALL) -> list[SSEEvent]:
    parser = SSEParser(limits)
    size = max(1, -(-len(stream) // pieces))
    events: list[SSEEvent] = []
    for i in range(0, len(stream), size):
        events.extend(parser.feed(stream[i:i + size]))
    return events


LIMIT_CASES: dict[str, tuple[bytes, str | None]] = {
    # (stream, the limit it breaks or None); "data: " is 6 bytes of a 16-byte line.
    "line-at-limit": (b"data: 0123456789\n\n", None),
    "line-over-limit": (b"data: 0123456789A\n\n", "line"),
    "comment-over-limit": (b": 0123456789ABCDEF\ndata: a\n\n", "line"),
    "unterminated-line-over-limit": (b"data: a\n\ndata: 0123456789ABCDEF", "line"),
    "crlf-not-counted": (b"data: 0123456789\r\n\r\n", None),
    "event-at-limit": (b"data: 0123456789\ndata: 0123456789\n\n", None),      # 10+1+10=21
    "event-over-limit": (b"data: 0123456789\ndata: 0123456789\ndata: 0123456789\n\n", "event"),
    "open-event-over-limit": (b"data: 0123456789\ndata: 0123456789\ndata: 0123456789\n",
                              "event"),
    "data-lines-at-limit": (b"data\n" * 4 + b"\n", None),
    "data-lines-over-limit": (b"data\n" * 5 + b"\n", "data_lines"),
    "open-data-lines-over-limit": (b"data\n" * 5, "data_lines"),
    "limits-reset-per-event": (b"data: 0123456789\ndata: 0123456789\n\n" * 3, None),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", list(LIMIT_CASES))
def test_limits_hold_however_the_stream_is_split(name: str) -> None:
    stream, broken = LIMIT_CASES[name]
    for pieces in (1, 2, 3, len(stream)):
        if broken is None:
            _feed_all(stream, pieces)
            continue
        with pytest.raises(SSELimitError) as info:
            _feed_all(stream, pieces)
        assert info.value.kind == broken, (pieces, info.value)


@pytest.mark.timeout(10)
def test_default_limits_and_their_messages() -> None:
    assert SSELimits() == SSELimits(max_line_bytes=1 << 20, max_event_bytes=4 << 20,
                                    max_data_lines=65_536)
    with pytest.raises(SSELimitError, match=r"^an SSE line longer than 1 MiB \(the parser's "
                                            r"line limit\)$"):
        SSEParser().feed(b"x" * ((1 << 20) + 1))
    with pytest.raises(SSELimitError, match=r"^an SSE event with more than 4 MiB of data"):
        parser = SSEParser()
        for _ in range(5):
            parser.feed(b"data: " + b"x" * 1_000_000 + b"\n")


def _feed_reads(parser: SSEParser, piece: bytes) -> list[SSEEvent]:
    """1 MiB - 8 in reads of ``piece`` (8 bytes): 131,071 reads, then a line end."""
    for _ in range(((1 << 20) - 8) // 8):
        parser.feed(piece)
    return parser.feed(b"\n")


@pytest.mark.timeout(60)
def test_a_line_that_never_ends_costs_linear_time() -> None:
    # 1 MiB - 1 in 8-byte reads: 131,072 reads. Copying the held line on every read (as this
    # parser once did) is 64 GiB of copying; a list of reads joined once is a few ms per MiB.
    # Compared, in CPU time (competing load does not count), with the same reads of lines that
    # each end at once: nothing held, linear by construction, measured right here.
    _, ended_s = cpu_s(lambda: _feed_reads(SSEParser(), b"xxxxxxx\n"))
    parser = SSEParser()
    held, held_s = cpu_s(lambda: _feed_reads(parser, b"x" * 8))
    assert held == []
    assert held_s < 3 * ended_s + 0.05, (held_s, ended_s)
    with pytest.raises(SSELimitError):
        for _ in range(3):
            parser.feed(b"x" * (1 << 19))      # the next line never ends either


@pytest.mark.timeout(30)
def test_data_lines_forever_raise_before_memory_grows() -> None:
    # What a target that sends "data:" lines and never a blank line looks like: the old parser
    # held every line until the process ran out of memory.
    parser = SSEParser()
    read = b"data: " + b"y" * 121 + b"\n"
    read *= 1024                                   # 64 KiB reads
    fed = 0
    with pytest.raises(SSELimitError) as info:
        for _ in range(10_000):
            parser.feed(read)
            fed += len(read)
    assert info.value.kind == "event"
    assert fed <= (4 << 20) + len(read)


@pytest.mark.timeout(60)
def test_a_persisted_long_id_is_not_decoded_per_event() -> None:
    # A 512 KiB id, then 100,000 tiny events that all carry it: decoding it per event would be
    # 50 GB of work; it is decoded once, when its line arrives. Compared, in CPU time, with the
    # same events under a one-digit id, measured right here.
    def events_after(id_line: bytes) -> list[SSEEvent]:
        parser = SSEParser()
        parser.feed(id_line)
        return parser.feed(b"data:\n\n" * 100_000)

    _, short_s = cpu_s(lambda: events_after(b"id: 7\n"))
    events, long_s = cpu_s(lambda: events_after(b"id: " + b"7" * (1 << 19) + b"\n"))
    assert len(events) == 100_000 and len(events[-1].id or "") == 1 << 19
    assert long_s < 3 * short_s + 0.05, (long_s, short_s)
