"""protocols: the one place that knows each wire format.

``get(name)`` gives the format's ``WireProtocol``: how the load generator asks for a stream and
reads it, at which routes the embedded target serves it and how it parses requests and encodes
its stream, and which events carry generated text (for the fault proxy). One module per format,
named as in ``Protocol``; adding a format is one module, one line in ``Protocol`` and one in
``_REGISTRY`` (the embedded target loops over it).
"""

from __future__ import annotations

from streamquake.protocols import anthropic, gemini, llama_cpp, openai, openai_responses, sse
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
    "get",
    "names",
    "readers",
    "stamp",
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
