"""What the SSE fault proxy costs: events/s and added latency per event, proxy vs direct.

    .venv/bin/python benchmarks/proxy_overhead.py [--streams 8] [--events 2000] [--gap-ms 5]

One upstream process (this file, ``--serve-upstream``) streams events that carry the wall-clock
time they were written; the client (this process) reads the same streams directly, through the
proxy with no fault, and through the proxy with a fault that inspects every event but never
fires (so the per-event fault path is paid in full). Two measurements, each in the same run:

* throughput: ``--streams`` concurrent streams of ``--events`` events written back to back;
* latency: the same streams paced ``--gap-ms`` apart, read on all three paths *at once*, the
  upstream writing event i of every stream at the same scheduled instant. "Added latency" is the
  paired difference per event (arrival through the proxy minus arrival of the same event
  direct), and its p50/p99 are percentiles of those differences: not the difference of two
  percentiles, which can even be smaller at p99 than at p50 and says nothing about one event.

Everything shares the machine's cores, so read the ratios rather than the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web  # noqa: E402

from streamquake import procs  # noqa: E402
from streamquake.faults.proxy.server import start_proxy  # noqa: E402

# A content event the proxy must parse as JSON to decide on (like a real token chunk).
_EVENT = b'id: %d\ndata: {"t":%d,"choices":[{"delta":{"content":"tok "},"finish_reason":null}]}\n\n'


# --- the upstream -------------------------------------------------------------------------------


def serve_upstream() -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        n = int(request.query["n"])
        gap = float(request.query.get("gap_ms", "0")) / 1000
        t0 = int(request.query.get("t0_ns", "0"))   # paced on a shared wall clock when given
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, n + 1):
            due = t0 + round(i * gap * 1e9)
            if gap:
                await asyncio.sleep(max(0.0, (due - time.time_ns()) / 1e9))
            await resp.write(_EVENT % (i, due if t0 else time.time_ns()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/stream", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"LISTENING http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# --- the client ---------------------------------------------------------------------------------


Arrivals = dict[tuple[int, int], tuple[int, int]]   # (stream, event id) -> (scheduled, arrived)


async def read_stream(session: ClientSession, url: str, stream: int,
                      arrivals: Arrivals | None) -> int:
    events = 0
    buf = b""
    async with session.get(url) as resp:
        async for chunk in resp.content.iter_any():
            now = time.time_ns()
            buf += chunk
            *done, buf = buf.split(b"\n\n")
            events += len(done)
            if arrivals is not None:
                for raw in done:
                    if raw.startswith(b"id:"):
                        event_id = int(raw.split(b"\n", 1)[0][3:])
                        due = json.loads(raw.split(b"data: ", 1)[1])["t"]
                        arrivals[(stream, event_id)] = (due, now)
    return events


async def run_streams(base: str, streams: int, events: int) -> tuple[int, float]:
    url = f"{base}/stream?n={events}&gap_ms=0"
    async with ClientSession(connector=TCPConnector(limit=0),
                             timeout=ClientTimeout(total=120)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(read_stream(session, url, k, None)
                                        for k in range(streams)))
        return sum(counts), time.perf_counter() - start


async def run_paced(bases: dict[str, str], streams: int, events: int, gap_ms: float,
                    arrivals: dict[str, Arrivals]) -> None:
    """Every path's streams at once, each event due at the same instant on every path."""
    t0 = time.time_ns() + 500_000_000
    async with ClientSession(connector=TCPConnector(limit=0),
                             timeout=ClientTimeout(total=120)) as session:
        await asyncio.gather(*(
            read_stream(session, f"{base}/stream?n={events}&gap_ms={gap_ms}&t0_ns={t0}", k,
                        arrivals[name])
            for name, base in bases.items() for k in range(streams)))


def control(url: str, method: str, body: dict[str, object] | None = None) -> None:
    data = None if body is None else json.dumps(body).encode()
    urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=5).read()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--events", type=int, default=2000, help="events per stream (throughput)")
    p.add_argument("--paced-events", type=int, default=300, help="events per stream (latency)")
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_upstream:
        serve_upstream()
        return

    import subprocess

    up = procs.spawn([sys.executable, __file__, "--serve-upstream"], stdout=subprocess.PIPE)
    try:
        upstream = procs.read_listening_line(up, 15, "the benchmark upstream")
        with start_proxy(upstream) as proxy:
            fault_url = proxy.control_url + "/faults/inspect-only"

            def with_fault(on: bool) -> None:
                if on:
                    control(fault_url, "PUT", {"truncate_after_events": 10**9, "drop": 0.0})
                else:
                    control(fault_url, "DELETE")

            paths = {"direct": (upstream, False), "proxy": (proxy.url, False),
                     "proxy+fault": (proxy.url, True)}
            rate: dict[str, float] = {}
            for _ in range(args.rounds):
                for name, (base, fault) in paths.items():
                    with_fault(fault)
                    n, secs = asyncio.run(run_streams(base, args.streams, args.events))
                    rate[name] = max(rate.get(name, 0.0), n / secs)
                    with_fault(False)
            # Latency: all paths at once; the fault path gets its own proxy process, so that the
            # inspecting fault does not apply to the plain proxy path's streams.
            with start_proxy(upstream) as faulty:
                control(faulty.control_url + "/faults/inspect-only", "PUT",
                        {"truncate_after_events": 10**9, "drop": 0.0})
                bases = {"direct": upstream, "proxy": proxy.url, "proxy+fault": faulty.url}
                arrivals: dict[str, Arrivals] = {k: {} for k in bases}
                for _ in range(args.rounds):
                    asyncio.run(run_paced(bases, args.streams, args.paced_events, args.gap_ms,
                                          arrivals))
    finally:
        procs.stop(up)
        if up.stdout is not None:
            up.stdout.close()

    print(f"{args.streams} concurrent streams; throughput: {args.events} events/stream back to "
          f"back; latency: {args.paced_events} events/stream every {args.gap_ms:g} ms")
    print(f"{'path':<12} {'events/s':>10} {'vs direct':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'added p50':>9} {'added p99':>9} {'pairs':>7}")
    direct = arrivals["direct"]
    for name in paths:
        got = arrivals[name]
        lat = [(arrived - due) / 1e6 for due, arrived in got.values()]
        added = [(got[k][1] - direct[k][1]) / 1e6 for k in got.keys() & direct.keys()]
        a50, a99 = ((pct(added, 50), pct(added, 99)) if name != "direct" else (0.0, 0.0))
        print(f"{name:<12} {rate[name]:>10.0f} {rate[name] / rate['direct']:>9.2f} "
              f"{pct(lat, 50):>8.2f} {pct(lat, 99):>8.2f} {a50:>9.2f} {a99:>9.2f} "
              f"{len(added):>7}")
    print(f"mean added latency through the proxy "
          f"{statistics.mean((arrivals['proxy'][k][1] - direct[k][1]) / 1e6 for k in direct):.2f}"
          " ms (paired per event)")


if __name__ == "__main__":
    main()
