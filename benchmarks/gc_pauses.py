"""How long the garbage collector holds a load process's hub, under each collection policy.

    .venv/bin/python benchmarks/gc_pauses.py [--streams 1000,2500] [--seconds 60]
        [--policies default,freeze,streamquake] [--json FILE]

The client path of a load process (as ``streams_sweep.py``'s ``streamquake`` client: gevent's
monkey patching, N greenlets each looping ``StreamClient.measure`` with its own client and
writing every sample as a JSON line, as the locustfile does) against ``fast_target.py`` (TTFT
100 ms, ITL 300 ms, 40 tokens: a 12 s stream, so N streams stay open and about N/12 end every
second). The target runs pinned to core 0; each (N, policy) in turn in its own process pinned
to core 1, its users' first starts spread over one stream's length; after a warm-up of one
stream plus 3 s, a window of ``--seconds`` is measured. Policies:

* ``default``: the interpreter's own thresholds (700, 10, 10), nothing frozen;
* ``freeze``: as default, plus ``gc.collect()`` and ``gc.freeze()`` once the users are spawned;
* ``streamquake``: what a load process does (``loadgen/collector.py``): ``collector.start``
  at the start, ``collector.settle`` once the users are spawned (Locust's
  ``spawning_complete``), the memory valve running.

Per row, over the window, from ``gc.callbacks`` (each collection timed in the thread's CPU time,
which a busy shared core does not stretch, and in wall time): the longest pause of any
collection and of a full one, the collections (full ones apart), their total CPU time as a share
of the process's CPU; RSS (``VmRSS``) at the window's start and end and its growth per minute (a
least-squares slope over one reading a second); and the load average. The CPU figures and the
ratios between the rows of one run are what count on a shared machine.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    from gevent import monkey  # before anything imports socket: what Locust does

    monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TTFT_MS, ITL_MS, TOKENS = 100.0, 300.0, 40
STREAM_S = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1000.0
TARGET_CORE, LOAD_CORE = "0", "1"
POLICIES = ("default", "freeze", "streamquake")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / den if den else None


def child(url: str, streams: int, policy: str, seconds: float) -> dict[str, Any]:
    import gc
    import random

    import gevent

    from streamquake.loadgen import collector
    from streamquake.loadgen.client import StreamClient
    from streamquake.loadgen.plan import LoadPlan, RequestClassPlan

    warm_s = STREAM_S + 3.0
    pauses: list[tuple[int, float, float]] = []      # generation, CPU ms, wall ms
    measuring = [False]
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.thread_time(), time.perf_counter()]
        elif measuring[0] and started:
            pauses.append((info["generation"], (time.thread_time() - started[0]) * 1e3,
                           (time.perf_counter() - started[1]) * 1e3))

    gc.callbacks.append(on_gc)
    if policy == "streamquake":
        collector.start(None, force=True)
    workdir = Path(tempfile.mkdtemp(prefix="sq-gc-"))
    plan = LoadPlan(base_url=url, protocol="openai", timeout_s=60.0,
                    classes=[RequestClassPlan(prompts=["Say something."], max_tokens=64)],
                    samples_path=str(workdir), end_at=time.time() + warm_s + seconds + 60)
    cls = plan.classes[0]
    sink = open(workdir / "samples.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    done = [0, 0]       # requests, failed ones

    def user(i: int) -> None:
        gevent.sleep(STREAM_S * i / streams)
        sc = StreamClient(plan, concurrency=1)
        rng = random.Random(i)
        while True:
            sample = sc.measure(cls, rng)
            sink.write(sample.to_json() + "\n")
            sink.flush()
            done[0] += 1
            done[1] += sample.error is not None

    users = [gevent.spawn(user, i) for i in range(streams)]
    gevent.sleep(STREAM_S + 0.5)      # every user has started (as spawning_complete)
    if policy == "freeze":
        gc.collect()
        gc.freeze()
    elif policy == "streamquake":
        collector.settle()
    gevent.sleep(max(0.0, warm_s - STREAM_S - 0.5))
    rss: list[tuple[float, float]] = []
    cpu0, t0, req0 = time.process_time(), time.perf_counter(), done[0]
    measuring[0] = True
    while (now := time.perf_counter()) < t0 + seconds:
        rss.append((now - t0, rss_mb()))
        gevent.sleep(1.0)
    measuring[0] = False
    cpu = time.process_time() - cpu0
    rss.append((time.perf_counter() - t0, rss_mb()))
    gevent.killall(users, timeout=5)
    sink.close()
    full = [p for p in pauses if p[0] == 2]
    return {
        "streams": streams, "policy": policy, "seconds": seconds,
        "requests": done[0] - req0, "failed": done[1],
        "collections": len(pauses), "full": len(full),
        "max_cpu_ms": max((p[1] for p in pauses), default=0.0),
        "max_wall_ms": max((p[2] for p in pauses), default=0.0),
        "full_max_cpu_ms": max((p[1] for p in full), default=None),
        "young_max_cpu_ms": max((p[1] for p in pauses if p[0] < 2), default=None),
        "gc_cpu_ms": sum(p[1] for p in pauses), "cpu_s": cpu,
        "rss_start_mb": rss[0][1], "rss_end_mb": rss[-1][1],
        "rss_mb_per_min": slope_per_min(rss),
        "frozen": gc.get_freeze_count(),
    }


def run_child(url: str, streams: int, policy: str, seconds: float) -> dict[str, Any]:
    cmd = ["taskset", "-c", LOAD_CORE, sys.executable, __file__, "--child", url, str(streams),
           policy, str(seconds)]
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          timeout=seconds + 4 * STREAM_S + 120)
    if done.returncode != 0:
        return {"streams": streams, "policy": policy, "failed_run": done.stderr[-2000:]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["loadavg"] = f"{load:.1f}-{os.getloadavg()[0]:.1f}"
    return row


def _f(v: Any, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| streams | policy | longest GC pause CPU / wall ms | longest full ms CPU | longest "
           "young ms CPU | collections (full) | GC CPU ms (% of process CPU) | requests | RSS "
           "start / end MB | RSS MB/min | load avg |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "failed_run" in r:
            out.append(f"| {r['streams']:,} | {r['policy']} | failed: "
                       f"{r['failed_run'][-120:]!r} |")
            continue
        share = 100.0 * r["gc_cpu_ms"] / 1000.0 / r["cpu_s"] if r["cpu_s"] else None
        out.append(
            f"| {r['streams']:,} | {r['policy']} | {_f(r['max_cpu_ms'])} / "
            f"{_f(r['max_wall_ms'])} | {_f(r['full_max_cpu_ms'])} | "
            f"{_f(r['young_max_cpu_ms'])} | {r['collections']} ({r['full']}) | "
            f"{_f(r['gc_cpu_ms'], '.0f')} ({_f(share)}%) | {r['requests']:,} | "
            f"{r['rss_start_mb']:.0f} / {r['rss_end_mb']:.0f} | "
            f"{_f(r['rss_mb_per_min'], '+.2f')} | {r['loadavg']} |")
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        url, streams, policy, seconds = sys.argv[2:6]
        print(json.dumps(child(url, int(streams), policy, float(seconds))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1000,2500")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"# gc pauses {time.strftime('%Y-%m-%d %H:%M')}: {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"target on core {TARGET_CORE}, client on core {LOAD_CORE}; {TOKENS} tokens, ITL "
          f"{ITL_MS:g} ms, window {args.seconds:g} s", flush=True)
    cmd = ["taskset", "-c", TARGET_CORE, sys.executable, str(ROOT / "benchmarks" /
           "fast_target.py"), "--ttft-ms", f"{TTFT_MS:g}", "--itl-ms", f"{ITL_MS:g}",
           "--tokens", str(TOKENS)]
    target = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    rows: list[dict[str, Any]] = []
    try:
        assert target.stdout is not None
        timer = threading.Timer(30, target.kill)     # a target that never says its URL
        timer.start()
        url = target.stdout.readline().strip()
        timer.cancel()
        if not url.startswith("http://"):
            raise SystemExit(f"fast_target.py did not start (exit code {target.wait()})")
        for n in (int(s) for s in args.streams.split(",")):
            for policy in args.policies.split(","):
                rows.append(run_child(url, n, policy, args.seconds))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        target.terminate()
        target.wait(10)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
