"""The words the simulated model says. The wire formats it says them in live in
``streamquake.protocols``."""

from __future__ import annotations

import json

# Kept importable from here for benchmarks/target_events.py, written before protocols/;
# new code imports them from streamquake.protocols.
from streamquake.protocols import Completion as Completion
from streamquake.protocols import WireProtocol, get, names

# Short words a simulated model emits, one per event, each followed by a space.
VOCABULARY: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then",
    "streams", "tokens", "to", "every", "client", "that", "waits", "for", "its", "answer",
    "while", "faults", "shake", "network", "under", "load", "in", "real", "time", "again", "now",
)

# Each word as its JSON string literal with the trailing space, encoded once at import: the
# encoders take tokens already encoded (StreamEncoder.token).
TOKEN_JSON: tuple[bytes, ...] = tuple(json.dumps(w + " ").encode() for w in VOCABULARY)

# See above: for benchmarks/target_events.py only.
FORMATS: dict[str, WireProtocol] = {name: get(name) for name in names()}


TOOL_NAME = "search"


def tool_piece(word: int, first: bool, last: bool) -> bytes:
    """One delta of the simulated tool call's JSON arguments, ``{"query": "<words>"}``, as a
    JSON string: the first opens the object, the last closes it."""
    text = VOCABULARY[word] + " "
    piece = ('{"query": "' if first else "") + text + ('"}' if last else "")
    return json.dumps(piece).encode()
