"""Which of the load process's hot loops run compiled: ``_speedups`` (C, built by
``scripts/setup`` through ``setup.py``) where it was built, else their Python originals, which
stay and are tested equal to it (tests/test_speedups.py). ``STREAMQUAKE_SPEEDUPS=0`` in the
environment picks Python even where the compiled module is there (benchmarks compare the two in
one run). The run's report says which ran (``environment.read_path``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, Protocol

__all__ = ["Chunked", "ChunkedBody", "FramedStep", "compiled", "count_ms", "describe",
           "framed_events", "pairs_le32", "read_round", "recv_stamped", "varints"]


class ChunkedBody(Protocol):
    """What a ``_speedups.Chunked`` is, for the type checker."""

    def read(self, fd: int, /) -> tuple[bytes, float, float, int, bytes | None]: ...

    def feed(self, data: bytes, /) -> tuple[bytes, bytes | None]: ...


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("STREAMQUAKE_SPEEDUPS", "1") == "0":
        return None, "python (STREAMQUAKE_SPEEDUPS=0)"
    try:
        from streamquake.loadgen import _speedups
    except ImportError as exc:
        return None, f"python (the compiled part is not built: {exc})"
    return _speedups, "compiled (streamquake.loadgen._speedups)"


compiled, _WHY = _load()
# The compiled twins, None where Python runs (their callers hold the Python originals).
count_ms: Callable[[dict[int, int], Iterable[float], int, int, int, int, int], int] | None = (
    None if compiled is None else compiled.count_ms)
recv_stamped: Callable[[int, int], tuple[bytes, float, float]] | None = (
    None if compiled is None else compiled.recv_stamped)
pairs_le32: Callable[[dict[int, int]], bytes] | None = (
    None if compiled is None else compiled.pairs_le32)
varints: Callable[[dict[int, int]], bytes] | None = (
    None if compiled is None else compiled.varints)
framed_events: Callable[[bytes, bytes, bytes], tuple[int, int]] | None = (
    None if compiled is None else compiled.framed_events)
# A body's plain chunked framing, decoded with its reads (client._hand_over); else the HTTP
# parser's, read by read.
Chunked: Callable[[], ChunkedBody] | None = None if compiled is None else compiled.Chunked
# A stream's step in the shared reader where its framing is decoded so: its reads of template
# events only folded in C (client._Stream.stepper); else the stream's own step.
# (Typed loosely: reader.py, whose Step it is, imports this module.)
FramedStep: Callable[[object, object, object, float, float], Callable[[], Any]] | None = (
    None if compiled is None else compiled.FramedStep)

# The shared reader's round: the ready sockets' steps called in C (reader.Reader._round).
read_round: Callable[[int, dict[int, Any], int], tuple[int, list[Any]]] | None = (
    None if compiled is None else compiled.read_round)


def describe() -> str:
    """Which path this process runs, in words, for reports and benchmarks."""
    return _WHY
