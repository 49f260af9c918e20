"""What a stream's events look like, in words, and which formats read them: for a run told that
its format found no text in a server's answer (a protocol mismatch, ``run/probe.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from streamquake.protocols.base import Event, ProtocolError, WireProtocol

_KEYS_SHOWN = 8
_VALUE_SHOWN = 40
# Keys whose value names the event's kind: shown as they are, not as "a string".
_KIND_KEYS = frozenset({"type", "object", "event"})


def _value(key: str, value: object, depth: int) -> str:
    if isinstance(value, str):
        if key in _KIND_KEYS:
            return json.dumps(value[:_VALUE_SHOWN])
        return "string" if value else '""'
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        if value and isinstance(value[0], dict) and depth < 2:
            return "[" + _object(value[0], depth + 1) + (", ..." if len(value) > 1 else "") + "]"
        return "list" if value else "[]"
    if isinstance(value, dict):
        return _object(value, depth + 1) if depth < 2 else "{...}"
    return type(value).__name__


def _object(obj: dict[str, object], depth: int = 0) -> str:
    items = list(obj.items())
    shown = ", ".join(f"{json.dumps(k)}: {_value(k, v, depth)}" for k, v in items[:_KEYS_SHOWN])
    return "{" + shown + (", ..." if len(items) > _KEYS_SHOWN else "") + "}"


def shape(event: Event) -> str:
    """One event's keys and value types, with ``type``-like values as sent: ``{"content":
    string, "stop": false, "tokens": list}``; its name first when it has one."""
    name = "" if event.event == "message" else f"event {event.event}: "
    try:
        obj = json.loads(event.data)
    except ValueError:
        data = event.data
        return name + repr(data if len(data) <= _VALUE_SHOWN else data[:_VALUE_SHOWN] + "...")
    return name + (_object(obj) if isinstance(obj, dict) else _value("", obj, 2))


def describe(events: Sequence[Event], most: int = 3) -> str:
    """The first event, then each event whose shape is new (``most`` in all), by number, and
    how many events there were: ``event 1 of 34: {...}; event 2: {...}``."""
    if not events:
        return "no event at all"
    seen: list[str] = []
    parts: list[str] = []
    for i, event in enumerate(events, 1):
        # Shapes differ by keys, not by the text in them.
        text = shape(event)
        if text in seen:
            continue
        seen.append(text)
        parts.append(f"event {i}{f' of {len(events)}' if i == 1 else ''}: {text}")
        if len(parts) == most:
            break
    return "; ".join(parts)


def readers(events: Sequence[Event], formats: Iterable[WireProtocol]) -> list[str]:
    """The formats that read text in ``events`` without a protocol error, and reach their end
    (a terminal event, or the body's end after a finish reason where the format allows it)."""
    found: list[str] = []
    for fmt in formats:
        text = done = finish = False
        try:
            for event in events:
                d = fmt.decode(event)
                text |= d.generated
                finish |= d.finish is not None
                done |= d.done
                if d.error is not None:
                    break
        except ProtocolError:
            continue
        if text and (done or (fmt.ends_with_body and finish)):
            found.append(fmt.name)
    return found
