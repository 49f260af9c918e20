"""Throughput of SSEParser against a naive split-on-blank-line parser, in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/sse_parser.py [--events 200000]

Two read patterns: one event per read (what a token stream looks like off a socket) and
16 KiB reads (a backlog drained at once). The naive baseline only splits on b"\\n\\n" and keeps
the data line; it is not conformant (no CR line ends, no multi-line data, no read-boundary CR),
which is the point: the ratio is what conformance costs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from streamquake.loadgen.sse_parser import SSEParser


def make_stream(events: int) -> list[bytes]:
    """OpenAI-shaped chunks, each with an ``id:`` line, one bytes object per event."""
    out = []
    for i in range(1, events + 1):
        chunk = {
            "id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
            "created": 1700000000, "model": "sim-1",
            "choices": [{"index": 0, "delta": {"content": f"tok{i % 97} "},
                         "logprobs": None, "finish_reason": None}],
        }
        out.append(b"id: %d\ndata: %s\n\n" % (i, json.dumps(chunk).encode()))
    return out


def rechunk(events: list[bytes], size: int) -> list[bytes]:
    blob = b"".join(events)
    return [blob[i:i + size] for i in range(0, len(blob), size)]


def run_parser(reads: list[bytes]) -> int:
    parser = SSEParser()
    n = 0
    for r in reads:
        n += len(parser.feed(r))
    return n


def run_naive(reads: list[bytes]) -> int:
    buf = b""
    n = 0
    for r in reads:
        buf += r
        *blocks, buf = buf.split(b"\n\n")
        for block in blocks:
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    line[5:].lstrip(b" ").decode()
            n += 1
    return n


def measure(fn: Callable[[list[bytes]], int], reads: list[bytes], repeat: int) -> tuple[float, int]:
    best = float("inf")
    count = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        count = fn(reads)
        best = min(best, time.perf_counter() - t0)
    return best, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    events = make_stream(args.events)
    total = sum(map(len, events))
    print(f"{args.events} events, {total / 1e6:.1f} MB, best of {args.repeat}")
    for label, reads in (("one event per read", events), ("16 KiB reads", rechunk(events, 16384))):
        rows = {}
        for name, fn in (("SSEParser", run_parser), ("naive split", run_naive)):
            secs, count = measure(fn, reads, args.repeat)
            assert count == args.events, (name, count)
            rows[name] = secs
            print(f"  {label:20s} {name:12s} {total / secs / 1e6:8.1f} MB/s "
                  f"{count / secs / 1e3:8.0f} k events/s")
        ratio = rows["naive split"] / rows["SSEParser"]
        print(f"  {label:20s} SSEParser / naive throughput: {ratio:.2f}")


if __name__ == "__main__":
    main()
