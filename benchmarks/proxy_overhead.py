"""What the SSE fault proxy costs: events/s and added latency per event, proxy vs direct.

    .venv/bin/python benchmarks/proxy_overhead.py [--streams 8] [--events 2000] [--gap-ms 5]
        [--paced-events 300] [--proxy-cpu 0]

One upstream process (this file, ``--serve-upstream``) streams events that carry the wall-clock
time they were written; the client (this process) reads the same streams directly, through the
proxy with no fault, and through the proxy with a fault that inspects every event but never
fires (so the per-event fault path is paid in full). Two measurements, each in the same run:

* throughput: ``--streams`` concurrent streams of ``--events`` events written back to back,
  with the CPU each process used meanwhile (the proxies alone on ``--proxy-cpu``, as with
  ``taskset``, the upstream and this client on the other CPUs);
* latency: the same streams paced ``--gap-ms`` apart, read on all three paths *at once*; stream
  k's event i is due at the same instant on every path (the streams spread evenly over one gap,
  as independent users are). "Added latency" is the paired difference per event: (arrival
  minus write) through the proxy minus (arrival minus write) of the same event direct, and its
  p50/p99 are percentiles of those differences: not the difference of two percentiles, which
  can even be smaller at p99 than at p50 and says nothing about one event.

Everything shares the machine's cores, so read the ratios rather than the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web  # noqa: E402

from streamquake import procs  # noqa: E402
from streamquake.faults.proxy.server import ProxyProcess  # noqa: E402

# A content event the proxy must parse as JSON to decide on (like a real token chunk): when it
# was due and when it was written (ns since the epoch).
_EVENT = (b'id: %d\ndata: {"t":%d,"w":%d,"choices":[{"delta":{"content":"tok "},'
          b'"finish_reason":null}]}\n\n')
INSPECT: dict[str, object] = {"truncate_after_events": 10**9, "drop": 0.0}


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
            now = time.time_ns()
            await resp.write(_EVENT % (i, due if t0 else now, now))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/stream", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        print(f"LISTENING http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# --- the client ---------------------------------------------------------------------------------


# (stream, event id) -> (due, written, arrived), ns since the epoch
Arrivals = dict[tuple[int, int], tuple[int, int, int]]


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
                        due, written = (int(raw.split(b'"%s":' % key, 1)[1].split(b",", 1)[0])
                                        for key in (b"t", b"w"))
                        arrivals[(stream, event_id)] = (due, written, now)
    return events


def session() -> ClientSession:
    return ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=600))


async def run_streams(base: str, streams: int, events: int) -> tuple[int, float]:
    url = f"{base}/stream?n={events}&gap_ms=0"
    async with session() as s:
        start = time.perf_counter()
        counts = await asyncio.gather(*(read_stream(s, url, k, None) for k in range(streams)))
        return sum(counts), time.perf_counter() - start


async def run_paced(bases: dict[str, str], streams: int, events: int, gap_ms: float,
                    arrivals: dict[str, Arrivals], pids: dict[str, int]) -> dict[str, float]:
    """Every path's streams at once, each event due at the same instant on every path; the
    streams' schedules spread evenly over one gap. Returns each pid's CPU seconds per event
    in the steady state: from the third gap to the last but one, all streams open."""
    # Time to connect them all (the proxy's share of that is about 1.5 ms of CPU a stream).
    t0 = time.time_ns() + 1_000_000_000 + len(bases) * streams * 2_000_000

    async def steady_cpu() -> dict[str, float]:
        marks = []
        for at in (t0 + 2.5 * gap_ms * 1e6, t0 + (events - 0.5) * gap_ms * 1e6):
            await asyncio.sleep(max(0.0, (at - time.time_ns()) / 1e9))
            marks.append({name: cpu_s(pid) for name, pid in pids.items()})
        slots = streams * (events - 3)
        return {name: (marks[1][name] - marks[0][name]) / slots for name in pids}

    async with session() as s:
        probe = asyncio.create_task(steady_cpu())
        await asyncio.gather(*(
            read_stream(s, f"{base}/stream?n={events}&gap_ms={gap_ms}"
                           f"&t0_ns={t0 + round(k / streams * gap_ms * 1e6)}", k, arrivals[name])
            for name, base in bases.items() for k in range(streams)))
        return await probe


def cpu_s(pid: int) -> float:
    """CPU seconds a process has run so far, to the nanosecond (the scheduler's own count; the
    user and system times in /proc/PID/stat are sampled at clock ticks, 10 ms)."""
    return sum(int((task / "schedstat").read_text().split()[0])
               for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def proxy_process(upstream: str, cpu: int | None) -> Iterator[ProxyProcess]:
    """A proxy as the runner starts one (``start_proxy``'s command), pinned to ``cpu``."""
    cmd = procs.python_module_cmd("streamquake.faults.proxy.server", "--upstream", upstream)
    proc = procs.spawn(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       env=procs.child_env())
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})
    try:
        url = procs.read_listening_line(proc, 15, "the SSE proxy")
    except BaseException:
        ProxyProcess(proc, "").stop()
        raise
    with ProxyProcess(proc, url) as proxy:
        yield proxy


def control(url: str, method: str, body: dict[str, object] | None = None) -> None:
    data = None if body is None else json.dumps(body).encode()
    urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=5).read()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")   # no event came on time: the machine is too busy to say
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--events", type=int, default=2000, help="events per stream (throughput)")
    p.add_argument("--paced-events", type=int, default=300, help="events per stream (latency)")
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--proxy-cpu", type=int, default=None,
                   help="pin the proxies to this CPU, the upstream and this client to the rest")
    p.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    # Every stream is a socket in each process: raise the soft limit (children inherit it).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.serve_upstream:
        serve_upstream()
        return
    if args.paced_events < 6:
        sys.exit("--paced-events: at least 6 (the CPU per event is read between the third and "
                 "the last but one)")
    fds = 5 * args.streams + 64   # the upstream's: 3 paths' streams at once, 2 via the proxies
    if fds > hard:
        sys.exit(f"--streams {args.streams} needs about {fds} file descriptors; limit {hard}")
    if args.proxy_cpu is not None:
        others = os.sched_getaffinity(0) - {args.proxy_cpu}
        if args.proxy_cpu not in os.sched_getaffinity(0) or not others:
            sys.exit(f"--proxy-cpu {args.proxy_cpu}: give one of several CPUs this process has")
        os.sched_setaffinity(0, others)   # the upstream inherits it

    up = procs.spawn([sys.executable, __file__, "--serve-upstream"], stdout=subprocess.PIPE)
    try:
        upstream = procs.read_listening_line(up, 15, "the benchmark upstream")
        with proxy_process(upstream, args.proxy_cpu) as proxy, \
                proxy_process(upstream, args.proxy_cpu) as faulty:
            # The fault path has a proxy process of its own, so that the inspecting fault does
            # not apply to the plain proxy path's streams when all are read at once.
            control(faulty.control_url + "/faults/inspect-only", "PUT", INSPECT)
            paths = {"direct": (upstream, 0), "proxy": (proxy.url, proxy.proc.pid),
                     "proxy+fault": (faulty.url, faulty.proc.pid)}
            rate: dict[str, float] = {}
            cpu: dict[str, tuple[float, ...]] = {}
            for _ in range(args.rounds):
                for name, (base, pid) in paths.items():
                    before = (cpu_s(pid) if pid else 0.0, cpu_s(up.pid), own_cpu_s())
                    n, secs = asyncio.run(run_streams(base, args.streams, args.events))
                    after = (cpu_s(pid) if pid else 0.0, cpu_s(up.pid), own_cpu_s())
                    if n / secs > rate.get(name, 0.0):
                        rate[name] = n / secs
                        cpu[name] = tuple((a - b) / secs for a, b in zip(after, before,
                                                                           strict=True))
            bases = {name: base for name, (base, _) in paths.items()}
            arrivals: dict[str, Arrivals] = {k: {} for k in bases}
            pids = {name: pid for name, (_, pid) in paths.items() if pid}
            # Paced, nearly every event is a read and a write of its own: CPU per event.
            paced_us = {name: 1e9 for name in pids}
            for _ in range(args.rounds):
                cost = asyncio.run(run_paced(bases, args.streams, args.paced_events, args.gap_ms,
                                             arrivals, pids))
                paced_us = {name: min(paced_us[name], cost[name] * 1e6) for name in pids}
    finally:
        procs.stop(up)
        if up.stdout is not None:
            up.stdout.close()

    print(f"{args.streams} concurrent streams; throughput: {args.events} events/stream back to "
          f"back; latency: {args.paced_events} events/stream every {args.gap_ms:g} ms; load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
          + (f"; proxies on CPU {args.proxy_cpu}" if args.proxy_cpu is not None else ""))
    # Events per CPU second, whoever else shares the machine: a proxy's is what it relays on a
    # core of its own; direct, the upstream's and the client's together are what that pair
    # does on one core (the other one, with --proxy-cpu on two). Their ratio is the throughput
    # ratio a quiet machine would show, as long as the proxy is the slower.
    print(f"{'path':<12} {'events/s':>9} {'vs direct':>9} {'CPU proxy':>9} {'per core':>9} "
          f"{'vs direct':>9} {'upstream':>8} {'client':>6} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'added p50':>9} {'added p99':>9} {'pairs':>7} {'us/event paced':>14}")
    # Events written more than half a gap after they were due came late to a stream that was
    # itself late (connecting, or a starved upstream): not the steady state measured here.
    late_ns = args.gap_ms * 1e6 / 2
    on_time = {name: {k: (w, a) for k, (due, w, a) in got.items() if w - due < late_ns}
               for name, got in arrivals.items()}
    direct = on_time["direct"]
    direct_core = rate["direct"] / sum(cpu["direct"][1:])
    for name in paths:
        got = on_time[name]
        lat = [(arrived - written) / 1e6 for written, arrived in got.values()]
        added = [((got[k][1] - got[k][0]) - (direct[k][1] - direct[k][0])) / 1e6
                 for k in got.keys() & direct.keys()]
        a50, a99 = ((pct(added, 50), pct(added, 99)) if name != "direct" else (0.0, 0.0))
        proxy_cpu, up_cpu, client_cpu = cpu[name]
        used = proxy_cpu if name != "direct" else up_cpu + client_cpu
        per_core = rate[name] / used if used else float("nan")
        shown = f"{proxy_cpu:.0%}" if name != "direct" else "-"
        print(f"{name:<12} {rate[name]:>9.0f} {rate[name] / rate['direct']:>9.2f} {shown:>9} "
              f"{per_core:>9.0f} {per_core / direct_core:>9.2f} {up_cpu:>8.0%} "
              f"{client_cpu:>6.0%} {pct(lat, 50):>7.2f} {pct(lat, 99):>7.2f} {a50:>9.2f} "
              f"{a99:>9.2f} {len(added):>7} {paced_us.get(name, 0.0):>14.1f}")
    proxied = on_time["proxy"]
    mean = statistics.fmean([((proxied[k][1] - proxied[k][0])
                              - (direct[k][1] - direct[k][0])) / 1e6
                             for k in direct.keys() & proxied.keys()] or [float("nan")])
    late = sum(len(got) - len(on_time[name]) for name, got in arrivals.items())
    print(f"mean added latency through the proxy {mean:.2f} ms (paired per event); "
          f"{late} of {sum(map(len, arrivals.values()))} events written late, left out")


if __name__ == "__main__":
    main()
