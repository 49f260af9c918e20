"""SSE event framing for the fault proxy, and the rules for what one event carries.

``SSEFramer`` cuts the upstream's bytes into raw event blocks without decoding them, so the proxy
can forward each block byte for byte. ``parse_event`` reads only the fields faults look at;
``is_content_event`` says whether losing an event loses generated text (see ``decisions.py``):
by the format's own rule when the proxy is told the protocol, else by sniffing the JSON, which
agrees with every format's rule on that format's events (``tests/test_protocols.py``);
``corrupt_event`` breaks an event's data so no JSON parser accepts it.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import orjson

from streamquake import protocols

_LINE_END = re.compile(rb"\r\n|\r|\n")
_LINE_END_KEPT = re.compile(rb"(\r\n|\r|\n)")
_CORRUPT_MARK = b"#~streamquake-corrupt~#"
_TEXT_KEYS = frozenset({"text", "content", "partial_json", "thinking", "reasoning_content",
                        "refusal"})
_FINISH_KEYS = frozenset({"finish_reason", "finishReason", "stop_reason"})
_CONTROL_EVENTS = frozenset({b"message_start", b"message_stop", b"message_delta",
                             b"content_block_start", b"content_block_stop", b"ping", b"error",
                             b"done"})


class SSEFramer:
    """Cuts a byte stream into raw SSE blocks, each ending with its blank line (LF, CR, CRLF)."""

    def __init__(self) -> None:
        self._rest = bytearray()
        self._line = 0  # where the line being scanned starts in _rest

    def feed_joined(self, chunk: bytes) -> tuple[bytes, list[int]]:
        """The complete blocks so far, as one ``bytes`` (no copy when ``chunk`` ends on a block's
        end and nothing was left before it), and where in it each block ends."""
        buf: bytes | bytearray = chunk
        if self._rest:
            self._rest += chunk
            buf = self._rest
        ends: list[int] = []
        pos = self._line
        if b"\r" in buf:
            while (m := _LINE_END.search(buf, pos)) is not None:
                if m.end() == len(buf) and m.end() - m.start() == 1 and buf[m.start()] == 0x0D:
                    break  # a lone CR at the end may be the first half of a CRLF
                if m.start() == pos:
                    ends.append(m.end())
                pos = m.end()
        else:  # LF only, as every engine writes it: memchr-speed searches
            while pos < len(buf):
                if buf[pos] == 0x0A:  # the line starting here is blank: it ends the block
                    pos += 1
                else:
                    blank = buf.find(b"\n\n", pos)
                    if blank < 0:
                        pos = buf.rfind(b"\n", pos) + 1 or pos  # the last line's start
                        break
                    pos = blank + 2
                ends.append(pos)
        done = ends[-1] if ends else 0
        self._line = pos - done
        if buf is chunk:
            if done < len(chunk):
                self._rest += chunk[done:]
            return chunk[:done], ends  # the chunk itself when it ends on a block's end
        data = bytes(buf[:done])
        del self._rest[:done]
        return data, ends

    def feed(self, chunk: bytes) -> list[bytes]:
        data, ends = self.feed_joined(chunk)
        return [data[start:end] for start, end in zip([0, *ends], ends, strict=False)]

    def flush(self) -> bytes:
        """What is left at the end of the body: an event without its blank line, or nothing."""
        rest = bytes(self._rest)
        self._rest.clear()
        self._line = 0
        return rest


class SSEEvent(NamedTuple):
    """One event's fields that faults look at (a tuple: one is made per event)."""

    name: bytes | None
    data: bytes | None


def parse_event(raw: bytes) -> SSEEvent | None:
    """The fields faults care about; ``None`` for a block of comments or blank lines only."""
    name: bytes | None = None
    data: list[bytes] = []
    fields = False
    for line in raw.split(b"\n") if b"\r" not in raw else _LINE_END.split(raw):
        if not line or line[0] == 0x3A:  # blank or ':' comment
            continue
        key, _, value = line.partition(b":")
        value = value[1:] if value[:1] == b" " else value
        fields = True
        if key == b"data":
            data.append(value)
        elif key == b"event":
            name = value
    if not fields:
        return None
    return SSEEvent(name, b"\n".join(data) if data else None)


def count_events(data: bytes, ends: list[int]) -> int:
    """How many of ``feed_joined``'s blocks are events (``parse_event`` is not ``None``)."""
    events = start = 0
    for end in ends:
        first = data[start]
        if first == 0x3A:  # a comment first: another line may still be a field
            events += parse_event(data[start:end]) is not None
        elif first != 0x0A and first != 0x0D:  # a block that starts blank is that blank line
            events += 1
        start = end
    return events


_FINISHED = -1


def _scan_json(obj: Any, depth: int = 0) -> int:
    """``_FINISHED`` at the first finish marker anywhere in ``obj`` (that settles it), else 1
    when it carries non-empty text, else 0. Types by identity: ``obj`` is parsed JSON."""
    if depth > 8:
        return 0
    text = 0
    if type(obj) is dict:
        for key, value in obj.items():
            if key in _FINISH_KEYS and value is not None:
                return _FINISHED
            if key in _TEXT_KEYS and type(value) is str and value:
                text = 1
            elif type(value) is dict or type(value) is list:
                found = _scan_json(value, depth + 1)
                if found == _FINISHED:
                    return found
                text |= found
    elif type(obj) is list:
        for value in obj:
            if type(value) is dict or type(value) is list:  # other values carry neither
                found = _scan_json(value, depth + 1)
                if found == _FINISHED:
                    return found
                text |= found
    return text


class _TextEvent(NamedTuple):
    """An event as ``protocols`` read it (``protocols.Event``)."""

    event: str
    data: str


def is_content_event(ev: SSEEvent, protocol: str | None = None) -> bool:
    """True when losing this event loses generated text and nothing else (see decisions.py).

    With ``protocol`` (a ``protocols.Protocol`` name) the format's own rule decides; without
    it, the JSON is sniffed for text and finish keys, for upstreams of any format.
    """
    if protocol is not None:
        decoded = _TextEvent(
            # As an SSE client dispatches it: no or an empty event name is "message".
            ev.name.decode("utf-8", "replace") if ev.name else "message",
            ev.data.decode("utf-8", "replace") if ev.data is not None else "",
        )
        return protocols.get(protocol).is_content_event(decoded)
    if ev.data is None or ev.name in _CONTROL_EVENTS:
        return False
    payload = ev.data.strip()
    if not payload or payload == b"[DONE]":
        return False
    try:
        obj = orjson.loads(payload)
    except ValueError:
        try:  # what orjson refuses and json takes (NaN, huge integers, UTF-16): as before
            obj = json.loads(payload)
        except ValueError:
            return True
    if isinstance(obj, dict) and "error" in obj:
        return False
    if isinstance(obj, dict) and str(obj.get("type")).startswith("response."):
        # OpenAI's Responses API: text is a string ``delta`` of a ``*.delta`` event; its other
        # events (``response.completed`` holds the whole output) are the stream's frame.
        kind, delta = str(obj["type"]), obj.get("delta")
        return kind.endswith(".delta") and type(delta) is str and bool(delta)
    return _scan_json(obj) == 1


def is_usage_event(ev: SSEEvent, protocol: protocols.WireProtocol) -> bool:
    """True when ``ev`` carries ``protocol``'s usage count and nothing else (see
    ``WireProtocol.is_usage_event``)."""
    if ev.data is None:
        return False
    return protocol.is_usage_event(_TextEvent(
        ev.name.decode("utf-8", "replace") if ev.name else "message",
        ev.data.decode("utf-8", "replace"),
    ))


def tool_args_delta(ev: SSEEvent, protocol: protocols.WireProtocol) -> protocols.ToolDelta | None:
    """The tool-call argument chunk ``ev`` carries in ``protocol``, if that is all it carries
    (see ``WireProtocol.tool_args_delta``)."""
    if ev.data is None:
        return None
    return protocol.tool_args_delta(_TextEvent(
        ev.name.decode("utf-8", "replace") if ev.name else "message",
        ev.data.decode("utf-8", "replace"),
    ))


def corrupt_event(raw: bytes) -> bytes:
    """Cut each data payload in half and append garbage, so no JSON parser accepts it."""
    parts = _LINE_END_KEPT.split(raw)
    for i in range(0, len(parts), 2):
        line = parts[i]
        if line.startswith(b"data:"):
            payload = line[5:]
            parts[i] = b"data:" + payload[: len(payload) // 2] + _CORRUPT_MARK
    return b"".join(parts)
