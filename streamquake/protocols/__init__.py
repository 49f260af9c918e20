"""protocols: the one place that knows each wire format.

``get(name)`` gives the format's ``WireProtocol``: how the load generator asks for a stream and
reads it, at which routes the embedded target serves it and how it parses requests and encodes
its stream, and which events carry generated text (for the fault proxy). One module per format,
named as in ``Protocol``; adding a format is one module, one line in ``Protocol`` and one in
``_REGISTRY`` (the embedded target loops over it).
"""

from __future__ import annotations

import re
from functools import cache

from streamquake.protocols import anthropic, gemini, llama_cpp, openai, openai_responses, sse
from streamquake.protocols._history import HISTORY_FORMATS, has_history, with_history
from streamquake.protocols._shapes import describe, readers
from streamquake.protocols.base import (
    BadRequest,
    Completion,
    Decoded,
    Event,
    GenRequest,
    Protocol,
    ProtocolError,
    StreamEncoder,
    ToolDelta,
    WireProtocol,
    stamp,
)

__all__ = [
    "HISTORY_FORMATS",
    "BadRequest",
    "Completion",
    "Decoded",
    "Event",
    "GenRequest",
    "Protocol",
    "ProtocolError",
    "StreamEncoder",
    "ToolDelta",
    "WireProtocol",
    "describe",
    "for_path",
    "get",
    "has_history",
    "names",
    "readers",
    "stamp",
    "with_history",
]

_REGISTRY: dict[str, WireProtocol] = {
    p.name: p for p in (gemini.PROTOCOL, openai.PROTOCOL, anthropic.PROTOCOL, sse.PROTOCOL,
                        openai_responses.PROTOCOL, llama_cpp.PROTOCOL)
}


def get(name: str) -> WireProtocol:
    """The format called ``name``; LookupError naming the known ones for any other name.

    Names that come from users are checked by the scenario schema (the ``Protocol`` literal)
    long before they get here, so an unknown name is a bug, not a user error.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LookupError(
            f"unknown wire protocol {name!r}; known: {', '.join(_REGISTRY)}"
        ) from None


def names() -> tuple[Protocol, ...]:
    """Every registered format's name; tests/test_protocols.py checks they are ``Protocol``'s."""
    return tuple(p.name for p in _REGISTRY.values())


def _route_pattern(path: str) -> re.Pattern[str]:
    # aiohttp's route syntax: ``{name}`` is one path segment, ``{name:regex}`` that regex.
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)(?::([^{}]+))?\}", path):
        out.append(re.escape(path[pos:m.start()]))
        out.append(f"(?:{m.group(2)})" if m.group(2) else "[^/]+")
        pos = m.end()
    out.append(re.escape(path[pos:]))
    return re.compile("".join(out))


@cache
def _routes() -> tuple[tuple[re.Pattern[str], WireProtocol], ...]:
    return tuple((_route_pattern(r.path), r.speaks or p)
                 for p in _REGISTRY.values() for r in p.routes())


def for_path(path: str) -> WireProtocol | None:
    """The format whose usual endpoint ``path`` (no query) ends with, if any: for a part that
    sees requests but was not told their format (the fault proxy). A prefix (a gateway's
    ``/openai``) is allowed; the longest match wins."""
    best: tuple[int, WireProtocol] | None = None
    for pattern, proto in _routes():
        for start in range(len(path)):
            if (start == 0 or path[start] == "/") and pattern.fullmatch(path, start):
                if best is None or len(path) - start > best[0]:
                    best = (len(path) - start, proto)
                break
    return None if best is None else best[1]
