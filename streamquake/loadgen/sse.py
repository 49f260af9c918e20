"""Incremental Server-Sent Events parser, after the WHATWG "event stream interpretation".

https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation

Bytes go in as they arrive off the socket; complete events come out at once, so the caller can
timestamp each one with the read that completed it. The parser works on bytes and decodes only
field values: every byte of a multi-byte UTF-8 character is >= 0x80, so splitting on CR/LF never
cuts one, and a character split across reads stays whole in the pending line.
"""

from __future__ import annotations

from typing import NamedTuple

_BOM = b"\xef\xbb\xbf"


class SSEEvent(NamedTuple):
    event: str = "message"      # the ``event:`` field, "message" when absent or empty
    data: str = ""              # ``data:`` lines joined by "\n"
    id: str | None = None       # the stream's last event ID at dispatch (it persists); None if ""
    retry: int | None = None    # a valid ``retry:`` given since the previous dispatch


class SSEParser:
    """Feed bytes with :meth:`feed`; call :meth:`close` at end of stream."""

    __slots__ = ("_pending", "_skip_lf", "_bom_checked", "_data", "_event", "_last_id", "_retry")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pending = b""          # an incomplete last line
        self._skip_lf = False        # the previous read ended in CR: a leading LF is its pair
        self._bom_checked = False
        self._data: list[bytes] = []
        self._event = b""
        self._last_id = b""
        self._retry: int | None = None

    @property
    def pending(self) -> bool:
        """True while bytes of an undispatched event (or line) are held."""
        return bool(self._pending or self._data or self._event or self._retry is not None)

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Parse one read's worth of bytes; return the events it completed, in order."""
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buf = self._pending + data if self._pending else data
        if not self._bom_checked:
            if len(buf) < 3 and _BOM.startswith(buf):
                self._pending = buf          # cannot tell yet whether this is a BOM
                return []
            self._bom_checked = True
            if buf.startswith(_BOM):
                buf = buf[3:]
        if b"\r" in buf:
            if buf[-1:] == b"\r":
                # A CR ending this read ends a line now; an LF opening the next read is its pair.
                self._skip_lf = True
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        self._pending = lines.pop()
        out: list[SSEEvent] = []
        if lines:
            self._process(lines, out)
        return out

    def close(self) -> list[SSEEvent]:
        """End of stream. Per the spec an unterminated event is discarded, so this returns []."""
        self._reset()
        return []

    def _process(self, lines: list[bytes], out: list[SSEEvent]) -> None:
        data = self._data
        last_id = self._last_id
        for line in lines:
            if not line:
                if data:
                    raw = data[0] if len(data) == 1 else b"\n".join(data)
                    out.append(SSEEvent(
                        self._event.decode("utf-8", "replace") if self._event else "message",
                        raw.decode("utf-8", "replace"),
                        last_id.decode("utf-8", "replace") if last_id else None,
                        self._retry,
                    ))
                    data = self._data = []
                self._event = b""
                self._retry = None
                continue
            # The two lines nearly every LLM event has, before the general field grammar.
            if line.startswith(b"data: "):
                data.append(line[6:])
                continue
            if line.startswith(b"id: ") and b"\0" not in line:
                last_id = line[4:]
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
                    last_id = value
            elif name == b"retry" and value.isdigit():
                self._retry = int(value)
        self._last_id = last_id
