"""Incremental Server-Sent Events parser, after the WHATWG "event stream interpretation".

https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation

Bytes go in as they arrive off the socket; complete events come out at once, so the caller can
timestamp each one with the read that completed it. The parser works on bytes and decodes only
field values: every byte of a multi-byte UTF-8 character is >= 0x80, so splitting on CR/LF never
cuts one, and a character split across reads stays whole in the pending line.

It is linear in its input (an unfinished line is kept as a list of reads and joined once, when
its end arrives) and bounded: a line, an event's data and its number of ``data:`` lines each have
a limit (:class:`SSELimits`); breaking one raises :class:`SSELimitError`, whatever way the stream
was split into reads.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

_BOM = b"\xef\xbb\xbf"

LimitKind = Literal["line", "event", "data_lines"]


class SSEEvent(NamedTuple):
    event: str = "message"      # the ``event:`` field, "message" when absent or empty
    data: str = ""              # ``data:`` lines joined by "\n"
    id: str | None = None       # the stream's last event ID at dispatch (it persists); None if ""
    retry: int | None = None    # a valid ``retry:`` given since the previous dispatch


# SSEEvent's own constructor without its keyword handling: one is made per event.
_new_event = tuple.__new__


class SSELimits(NamedTuple):
    """How much one stream may make the parser hold.

    The defaults are far above what any LLM API sends: a token event's line is 100-500 bytes,
    the largest (a final usage chunk, a whole tool call's arguments, grounding metadata) tens
    of KiB. 1 MiB per line is 1,000x that; 4 MiB per event leaves room for the rare multi-line
    event while capping what one stream can pin in memory (a load process runs hundreds). The
    line count bounds an event of empty ``data:`` lines, which the byte limit barely sees.
    """

    max_line_bytes: int = 1 << 20           # one line, without its line end
    max_event_bytes: int = 4 << 20          # an event's data: its data lines joined by "\n"
    max_data_lines: int = 65_536            # data lines in one event


class SSELimitError(Exception):
    """The stream broke one of the parser's limits; ``kind`` says which."""

    def __init__(self, kind: LimitKind, message: str) -> None:
        super().__init__(message)
        self.kind: LimitKind = kind


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"


class SSEParser:
    """Feed bytes with :meth:`feed`; call :meth:`close` at end of stream."""

    __slots__ = ("_pending", "_pending_len", "_skip_lf", "_bom_checked", "_data", "_data_len",
                 "_event", "_last_id", "_retry", "_max_line", "_max_event", "_max_lines")

    def __init__(self, limits: SSELimits | None = None) -> None:
        limits = limits or SSELimits()
        self._max_line = limits.max_line_bytes
        self._max_event = limits.max_event_bytes
        self._max_lines = limits.max_data_lines
        self._reset()

    def _reset(self) -> None:
        self._pending: list[bytes] = []  # the reads holding an incomplete last line
        self._pending_len = 0
        self._skip_lf = False        # the previous read ended in CR: a leading LF is its pair
        self._bom_checked = False
        self._data: list[bytes] = []
        self._data_len = 0           # bytes of the pending event's data, as joined so far
        self._event = b""
        self._last_id: str | None = None
        self._retry: int | None = None

    @property
    def last_id(self) -> str | None:
        """The last event ID (the ``id:`` field's), which the next event carries too."""
        return self._last_id

    @property
    def pending(self) -> bool:
        """True while bytes of an undispatched event (or line) are held."""
        return bool(self._pending or self._data or self._event or self._retry is not None)

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Parse one read's worth of bytes; return the events it completed, in order.

        Raises SSELimitError when the stream breaks a limit; the parser is then spent.
        """
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
                if not data:
                    return []
        if not self._bom_checked:
            if self._pending:
                data = b"".join(self._pending) + data
                self._pending, self._pending_len = [], 0
            if len(data) < 3 and _BOM.startswith(data):
                self._pending, self._pending_len = [data], len(data)   # cannot tell yet
                return []
            self._bom_checked = True
            if data.startswith(_BOM):
                data = data[3:]
                if not data:
                    return []
        if b"\r" in data:
            if data[-1:] == b"\r":
                # A CR ending this read ends a line now; an LF opening the next read is its pair.
                self._skip_lf = True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        tail = lines.pop()
        if self._pending or not lines:
            if not self._hold(lines, tail):
                return []
        elif tail:
            self._pending = [tail]
            self._pending_len = len(tail)
        if len(data) > self._max_line:
            self._check_lines(lines, tail)
        out: list[SSEEvent] = []
        self._process(lines, out)
        return out

    def plain(self, data: bytes) -> list[tuple[bytes, str | None]] | None:
        """The shortcut for the read nearly every LLM stream is made of: whole events, each one
        ``data:`` line (after an ``id:`` line or not), read at an event boundary. Their
        ``(data, id)``, the data undecoded (what :meth:`feed` would return of them); None for
        any other read, which then goes to :meth:`feed`. Changes nothing: :meth:`took` does,
        once the events are used."""
        if data[-2:] != b"\n\n" or b"\r" in data or not self.clean(len(data)):
            return None
        last_id = self._last_id
        if data[:6] == b"data: " and data.count(b"\n") == 2:
            return [(data[6:-2], last_id)]          # one event, the usual read
        out = []
        for event in data[:-2].split(b"\n\n"):
            if event[:6] == b"data: ":
                if b"\n" in event:
                    return None
                out.append((event[6:], last_id))
            elif event[:4] == b"id: ":
                line, _, event = event.partition(b"\n")
                if event[:6] != b"data: " or b"\n" in event or b"\0" in line:
                    return None
                last_id = line[4:].decode("utf-8", "replace") or None
                out.append((event[6:], last_id))
            else:
                return None
        return out

    def clean(self, size: int) -> bool:
        """Whether a read of ``size`` bytes that is whole events, with no CR, would be read by
        :meth:`plain` (the parser at an event boundary, no limit in reach): the checks
        :meth:`plain` makes of the parser, for a caller that has checked the bytes itself."""
        return not (self._pending or self._data or self._event or self._skip_lf
                    or not self._bom_checked or self._retry is not None
                    or size > self._max_line or size > self._max_event)

    def took(self, events: list[tuple[bytes, str | None]]) -> None:
        """The events :meth:`plain` gave were used: the stream goes on after them."""
        self._last_id = events[-1][1]

    def _hold(self, lines: list[bytes], tail: bytes) -> bool:
        """Reads held before this one, or this read without a line end: keep ``tail`` for
        later, join the held reads to the first line; False if no line is complete yet.

        Held reads stay a list until their line ends, so a line that never ends costs linear
        time, not a copy of everything held on every read.
        """
        held = self._pending_len if self._pending else 0
        if not lines:
            self._pending.append(tail)
            self._pending_len = held + len(tail)
            if self._pending_len > self._max_line:
                raise self._line_too_long()
            return False
        self._pending.append(lines[0])
        lines[0] = b"".join(self._pending)
        self._pending = [tail] if tail else []
        self._pending_len = len(tail)
        if len(lines[0]) > self._max_line:
            raise self._line_too_long()
        return True

    def _check_lines(self, lines: list[bytes], tail: bytes) -> None:
        if len(tail) > self._max_line or max(map(len, lines)) > self._max_line:
            raise self._line_too_long()

    def close(self) -> list[SSEEvent]:
        """End of stream. Per the spec an unterminated event is discarded, so this returns []."""
        self._reset()
        return []

    def _line_too_long(self) -> SSELimitError:
        return SSELimitError("line", f"an SSE line longer than {_size(self._max_line)} "
                                     "(the parser's line limit)")

    def _event_too_big(self, size: int, lines: int) -> SSELimitError:
        if lines > self._max_lines:
            return SSELimitError("data_lines", f"an SSE event with more than {self._max_lines:,} "
                                               "data lines (the parser's limit)")
        return SSELimitError("event", f"an SSE event with more than {_size(self._max_event)} "
                                      f"of data (the parser's event limit; {size:,} so far)")

    def _process(self, lines: list[bytes], out: list[SSEEvent]) -> None:
        data = start = self._data
        last_id = self._last_id
        max_event = self._max_event
        new_from = len(data)          # data lines added by this call start here
        for line in lines:
            if not line:
                if data:
                    if len(data) == 1:
                        raw = data[0]
                    else:
                        if len(data) > self._max_lines:
                            raise self._event_too_big(0, len(data))
                        raw = b"\n".join(data)
                    if len(raw) > max_event:
                        raise self._event_too_big(len(raw), len(data))
                    out.append(_new_event(SSEEvent, (
                        self._event.decode("utf-8", "replace") if self._event else "message",
                        raw.decode("utf-8", "replace"),
                        last_id,
                        self._retry,
                    )))
                    data = self._data = []
                self._event = b""
                self._retry = None
                continue
            # The two lines nearly every LLM event has, before the general field grammar.
            if line.startswith(b"data: "):
                data.append(line[6:])
                continue
            if line.startswith(b"id: ") and b"\0" not in line:
                # Decoded here, not per event: the id persists, and a 1 MiB id followed by a
                # million tiny events must not cost a million decodes.
                last_id = line[4:].decode("utf-8", "replace") or None
                continue
            colon = line.find(b":")
            if colon == 0:
                continue                             # comment
            if colon < 0:
                name, value = line, b""
            else:
                name = line[:colon]
                value = line[colon + 2:] if line[colon + 1:colon + 2] == b" " else line[colon + 1:]
            if name == b"data":
                data.append(value)
            elif name == b"event":
                self._event = value
            elif name == b"id":
                if b"\0" not in value:
                    last_id = value.decode("utf-8", "replace") or None
            elif name == b"retry" and value.isdigit():
                self._retry = int(value)
        self._last_id = last_id
        if not data:
            return
        # An event still open after this read: account for what it holds now, counting only
        # the lines this read added, so a stream of data lines stays linear. An event that began
        # in this read (a new list, or an empty one at the start) starts its count afresh.
        if data is not start or new_from == 0:
            new_from, self._data_len = 0, 0
        added = len(data) - new_from
        self._data_len += sum(map(len, data[new_from:])) + added
        size = self._data_len - 1               # joined by "\n": one fewer than the lines
        if size > max_event or len(data) > self._max_lines:
            raise self._event_too_big(size, len(data))
