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
from dataclasses import dataclass
from typing import Any, NamedTuple

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
        self._buf = bytearray()
        self._line = 0  # where the line being scanned starts in _buf

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf
        buf += chunk
        blocks: list[bytes] = []
        start, pos = 0, self._line
        while (m := _LINE_END.search(buf, pos)) is not None:
            if m.end() == len(buf) and m.end() - m.start() == 1 and buf[m.start()] == 0x0D:
                break  # a lone CR at the end may be the first half of a CRLF
            if m.start() == pos:
                blocks.append(bytes(buf[start:m.end()]))
                start = m.end()
            pos = m.end()
        del buf[:start]
        self._line = pos - start
        return blocks

    def flush(self) -> bytes:
        """What is left at the end of the body: an event without its blank line, or nothing."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._line = 0
        return rest


@dataclass(frozen=True)
class SSEEvent:
    name: bytes | None
    data: bytes | None


def parse_event(raw: bytes) -> SSEEvent | None:
    """The fields faults care about; ``None`` for a block of comments or blank lines only."""
    name: bytes | None = None
    data: list[bytes] = []
    fields = False
    for line in _LINE_END.split(raw):
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


def _scan_json(obj: Any, depth: int = 0) -> tuple[bool, bool]:
    """(carries non-empty text, carries a finish marker) anywhere in ``obj``."""
    if depth > 8:
        return False, False
    text = finished = False
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in _FINISH_KEYS and value is not None:
                finished = True
            elif key in _TEXT_KEYS and isinstance(value, str) and value:
                text = True
            elif isinstance(value, dict | list):
                t, f = _scan_json(value, depth + 1)
                text, finished = text or t, finished or f
    elif isinstance(obj, list):
        for value in obj:
            t, f = _scan_json(value, depth + 1)
            text, finished = text or t, finished or f
    return text, finished


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
        obj = json.loads(payload)
    except ValueError:
        return True
    if isinstance(obj, dict) and "error" in obj:
        return False
    text, finished = _scan_json(obj)
    return text and not finished


def corrupt_event(raw: bytes) -> bytes:
    """Cut each data payload in half and append garbage, so no JSON parser accepts it."""
    parts = _LINE_END_KEPT.split(raw)
    for i in range(0, len(parts), 2):
        line = parts[i]
        if line.startswith(b"data:"):
            payload = line[5:]
            parts[i] = b"data:" + payload[: len(payload) // 2] + _CORRUPT_MARK
    return b"".join(parts)
