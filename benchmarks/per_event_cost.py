"""CPU per event of each stage of streamquake's read path, in isolation, beside the whole.

    PYTHONPATH=. .venv/bin/python benchmarks/per_event_cost.py [--rounds 7]

One OpenAI stream of 50 tokens as the embedded target encodes it (with ``stamp_send_time``'s
comment on every event, as ``streams_sweep.py`` reads it), one event per read, the way a
client that keeps up reads it. Each stage is timed in process CPU time (so other work on a
shared machine costs wall time, not these figures), the best of ``--rounds``:

* ``read``: ``Arrival.recv`` of one event on a loopback TCP socket with kernel stamps
  (``recvmsg``, the stamp parsed, the clocks read): one event is written to each of 200
  connections, then the reads alone are timed, one event each.
* ``http``: geventhttpclient's chunked-body parser (llhttp) fed one event's chunk, and the
  body bytes taken out of its buffer, as ``_read_some`` does.
* ``sse``: ``SSEParser.feed`` of one event.
* ``decode``: the OpenAI format's ``decode`` of one event.
* ``tally``: ``_Tally.add`` of one event, without its decode (and, in one more row, the
  parse and ``_Tally.add`` with its decode, timed together as the client calls them).
* ``aiohttp json``: what vLLM's reader does per line in Python besides its I/O
  (strip, decode, prefix, ``json.loads``, the content lookup), for scale.

What the stages do not hold (gevent's wake-up and greenlet switch, epoll, the kernel's TCP
receive, per-request work spread over the stream's events) is the whole's cost, as
``streams_sweep.py`` measures it (1 / events per core), minus their sum.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geventhttpclient.response import HTTPResponse  # noqa: E402

from streamquake.loadgen.client import MAX_EVENTS  # noqa: E402
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan  # noqa: E402
from streamquake.loadgen.samples import RequestSample  # noqa: E402
from streamquake.loadgen.sse_parser import SSEParser  # noqa: E402
from streamquake.loadgen.stamps import _BLOCK, Arrival, enable_kernel_timestamps  # noqa: E402
from streamquake.loadgen.tally import _Tally  # noqa: E402
from streamquake.protocols import get  # noqa: E402
from streamquake.protocols.base import STAMP_SLOT, Completion, GenRequest  # noqa: E402

TOKENS = 50


def stream_events() -> list[bytes]:
    enc = get("openai").encoder(GenRequest(model="sim-1", prompt_tokens=3, max_tokens=TOKENS,
                                           include_usage=True), False)
    enc.stamp_send_time = True
    raw = [enc.token(json.dumps("tok ").encode()) for _ in range(TOKENS)]
    raw.append(enc.closing(Completion(TOKENS, False)))
    whole = b"".join(raw).replace(STAMP_SLOT, b"%d" % time.time_ns())
    return [e + b"\n\n" for e in whole.split(b"\n\n") if e]


def best(fn: Callable[[], int], rounds: int) -> float:
    """Seconds of CPU per event: ``fn`` returns how many events it handled."""
    out = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        n = fn()
        out = min(out, (time.process_time() - t0) / n)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=300, help="streams per round")
    p.add_argument("--sockets", type=int, default=200, help="connections read in turn")
    args = p.parse_args()
    repeat: int = args.repeat
    events = stream_events()
    plan = LoadPlan(base_url="http://127.0.0.1:1", protocol="openai", model="sim-1",
                    classes=[RequestClassPlan(prompts=["x"], max_tokens=64)],
                    samples_path="/nonexistent", end_at=0.0)
    parsed = [ev for e in events for ev in SSEParser().feed(e)]
    decode = get("openai").decode
    decoded = [decode(ev) for ev in parsed]

    def sse() -> int:
        for _ in range(repeat):
            parser = SSEParser()
            for e in events:
                parser.feed(e)
        return repeat * len(events)

    def dec() -> int:
        for _ in range(repeat):
            for ev in parsed:
                decode(ev)
        return repeat * len(parsed)

    known = dict(zip(map(id, parsed), decoded, strict=True))

    def tally(own: bool = True) -> int:
        for _ in range(repeat):
            t = _Tally(RequestSample(cls="c", sent=0.0), plan, 0.0, MAX_EVENTS)
            if own:
                t._decode = lambda ev: known[id(ev)]   # decoded already: the tally's own cost
            now = 1.0
            for ev in parsed:
                now += 0.02
                t.add(ev, now, now, True, False)
        return repeat * len(parsed)

    def http() -> int:
        chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(repeat):
            resp = HTTPResponse()
            resp.feed(head)
            buf = resp._body_buffer
            for ch in chunks:
                resp.feed(ch)
                bytes(buf)
                del buf[:]
        return repeat * len(events)

    def aiohttp_json() -> int:
        lines = [e.split(b"\n", 1)[1].strip() for e in events]
        for _ in range(repeat):
            for chunk_bytes in lines:
                chunk = chunk_bytes.strip().decode("utf-8").removeprefix("data: ")
                if chunk == "[DONE]":
                    continue
                time.perf_counter()
                data = json.loads(chunk)
                if choices := data.get("choices"):
                    choices[0]["delta"].get("content")
        return repeat * len(lines)

    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(512)
        pairs = []
        for _ in range(args.sockets):
            r = socket.create_connection(ls.getsockname())
            w, _ = ls.accept()
            w.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            enable_kernel_timestamps(r)
            pairs.append((r, w, Arrival(r, 0.0)))
        event = events[1]

        def read_cost() -> float:
            # One event waits on each socket; the reads alone are timed, one event each.
            out = float("inf")
            for _ in range(args.rounds):
                spent = 0.0
                for _ in range(10):
                    for _r, w, _a in pairs:
                        w.sendall(event)
                    t0 = time.process_time()
                    for r, _w, arrival in pairs:
                        arrival.recv(r, _BLOCK)
                    spent += time.process_time() - t0
                out = min(out, spent / (10 * len(pairs)))
            return out

        rows = {
            "read (Arrival.recv, loopback)": read_cost(),
            "http (llhttp chunk + buffer)": best(http, args.rounds),
            "sse (SSEParser.feed)": best(sse, args.rounds),
            "decode (OpenAI)": best(dec, args.rounds),
            "tally (_Tally.add, no decode)": best(tally, args.rounds),
        }
        for r, w, _a in pairs:
            r.close()
            w.close()
    total = sum(rows.values())
    rows["sum of the stages"] = total
    rows["sse + decode + tally, as the client calls them"] = (
        best(sse, args.rounds) + best(lambda: tally(False), args.rounds))
    rows["for scale: aiohttp reader's per-line Python (json.loads...)"] = best(aiohttp_json,
                                                                               args.rounds)
    print("| stage | us per event |\n|---|---:|")
    for name, s in rows.items():
        print(f"| {name} | {s * 1e6:.2f} |")


if __name__ == "__main__":
    main()
