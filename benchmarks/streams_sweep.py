"""How late each client sees each event, and what it costs, from 50 to 2,000 concurrent streams.

    .venv/bin/python benchmarks/streams_sweep.py [--streams 50,200,500,1000,2000] [--seconds 10]
        [--quick] [--clients streamquake,aiohttp,guidellm] [--json FILE]
        [--target embedded|fast] [--per-write 1]

The embedded target runs pinned to core 0 with ``stamp_send_time: true`` (every event opens
with ``: t=<epoch ns>``, read right before the write), TTFT 100 ms, ITL 20 ms, 50 tokens, in the
OpenAI format (``--target fast``: ``fast_target.py``, the same bytes pre-encoded and written
over bare asyncio, ``--per-write`` events to a write, so that the target is never what bounds
a client; its CPU is in the table either way). Each client in turn runs in its own process
pinned to core 1, closed loop (a stream ends, the next starts), its N streams' first starts
spread over one stream's length so that their tokens are not all due at the same instant.
After a warm-up, a window of ``--seconds`` is measured:

* ``streamquake``: N gevent greenlets (gevent's monkey patching, as under Locust), each with its
  own ``StreamClient`` (one socket, as each Locust user has) looping ``StreamClient.measure`` and
  writing every sample as a JSON line, as the locustfile does. The event times are the ones the
  client itself records: a benchmark-only hook wraps ``_Tally.add(event, now)`` (the ``now``
  that TTFT and ITL come from) and the SSE parser (to read the stamp comments it skips).
* ``aiohttp``: the read loop of vLLM's ``benchmark_serving`` (``async for line in
  response.content``, comments skipped, ``time.perf_counter()`` per data line, ``json.loads``),
  on one shared session, N tasks; it also notes the stamp from the comment line.
* ``guidellm``: ``guidellm run`` (PyPI, in its own venv, ``--guidellm-venv``), concurrent
  profile with N streams and the same ramp-up, offline (a ``json_file`` data set, no backend
  validation, a fixed model name). Its per-event times are not reachable, so its arrival error
  is not measured; its TTFT and mean ITL per request are compared with the configured 100/20 ms.

Per client and stream count: events/s (content events, i.e. tokens, that arrived in the
window), the client process's CPU (user + system, all its threads and processes) as a share of
one core, events/s per core of that CPU, the arrival error (arrival time as the client records
it minus the stamped send time) p50/p99/max, the TTFT error (the client's TTFT minus the true
one: the first content event's stamp minus the client's send time) and TTFT - 100 ms, the ITL
error (the client's gap minus the stamped gap), the target's CPU (it can be the bottleneck at
2,000 streams) and ratios to the aiohttp client of the same run.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:3] == ["--client", "streamquake"]:
    # Before anything imports socket or ssl: what Locust does, so what streamquake users get.
    from gevent import monkey

    monkey.patch_all()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from procstat import cpu_s as proc_cpu_s  # noqa: E402
from procstat import run_delay_s  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TTFT_MS = 100.0
ITL_MS = 20.0
TOKENS = 50
MODEL = "sim-1"
PATH = "/v1/chat/completions"
STREAM_S = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1000.0   # one stream's length: the ramp-up
TARGET_CORE, LOAD_CORE = "0", "1"
GUIDELLM_VENV = ROOT / ".sq-build" / "guidellm-venv"
CLIENTS = ("streamquake", "aiohttp", "guidellm")


# --- measuring, inside a client process ---------------------------------------------------------


class Recorder:
    """Collects what one client process saw in the window; times are perf_counter seconds
    unless they are already epoch seconds (a client that timestamps in the kernel's clock)."""

    def __init__(self, warm_s: float, seconds: float) -> None:
        self.offset_ns = time.time_ns() - time.perf_counter_ns()
        self.start = time.perf_counter()
        self.w0 = self.start + warm_s
        self.w1 = self.w0 + seconds
        self.events = 0
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.arrival_ns = array("q")
        self.ttft_err_ms = array("d")
        self.ttft_minus_cfg_ms = array("d")
        self.itl_err_ns = array("q")
        self.seen_ns = array("q")      # when the client's code saw it, where that differs
        self.cpu: list[tuple[float, float]] = []   # (perf_counter, cpu seconds) at w0 and w1
        self.waited: list[float] = []               # run-queue wait seconds at w0 and w1

    def ns(self, t: float) -> int:
        return int(t * 1e9) + (0 if t > 1e9 else self.offset_ns)

    def content(self, now: float, stamp: int, prev: tuple[float, int] | None,
                t0: float | None, ttft_ms: float | None) -> None:
        """One content event: ``prev`` is the stream's previous one, ``t0`` its send time and
        ``ttft_ms`` the client's TTFT when this is the stream's first."""
        if not self.w0 <= now <= self.w1:
            return
        self.events += 1
        self.arrival_ns.append(self.ns(now) - stamp)
        if prev is not None:
            self.itl_err_ns.append(int((now - prev[0]) * 1e9) - (stamp - prev[1]))
        if t0 is not None and ttft_ms is not None:
            self.ttft_err_ms.append(ttft_ms - (stamp - self.ns(t0)) / 1e6)
            self.ttft_minus_cfg_ms.append(ttft_ms - TTFT_MS)

    def request_done(self, error: str | None, ended: float) -> None:
        if self.w0 <= ended <= self.w1:
            self.requests += 1
            if error is not None:
                self.errors[error] = self.errors.get(error, 0) + 1

    def mark(self) -> None:
        """At w0 and at w1: CPU so far, and a line for the parent (it samples the target)."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu.append((time.perf_counter(), usage.ru_utime + usage.ru_stime))
        self.waited.append(run_delay_s(os.getpid()))
        print("WINDOW", flush=True)

    def result(self, client: str, streams: int) -> dict[str, Any]:
        (t0, c0), (t1, c1) = self.cpu[0], self.cpu[-1]
        window = self.w1 - self.w0
        return {
            "client": client, "streams": streams, "window_s": window,
            "events": self.events, "events_per_s": self.events / window,
            "cpu_share": (c1 - c0) / (t1 - t0),
            "wait_share": (self.waited[-1] - self.waited[0]) / (t1 - t0),
            "requests": self.requests, "errors": self.errors,
            "arrival_ms": quantiles([v / 1e6 for v in self.arrival_ns]),
            "seen_ms": quantiles([v / 1e6 for v in self.seen_ns]),
            "ttft_err_ms": quantiles(self.ttft_err_ms),
            "ttft_minus_cfg_ms": quantiles(self.ttft_minus_cfg_ms),
            "itl_err_ms": quantiles([v / 1e6 for v in self.itl_err_ns]),
        }


def quantiles(values: Iterable[float]) -> dict[str, float | int | None]:
    """Nearest-rank p50, p99 and max; None where there is nothing to rank."""
    ranked = sorted(values)
    n = len(ranked)

    def rank(q: float) -> float | None:
        return ranked[min(n - 1, max(0, math.ceil(q * n) - 1))] if n else None

    return {"n": n, "p50": rank(0.50), "p99": rank(0.99), "max": ranked[-1] if n else None}


def _stamps(carry: bytes, data: bytes, out: list[int]) -> bytes:
    """Append the ``: t=N`` stamps completed in ``carry + data``; return the new carry."""
    buf = carry + data if carry else data
    pos = 0
    while (i := buf.find(b": t=", pos)) >= 0:
        j = buf.find(b"\n", i)
        if j < 0:
            return buf[i:]
        out.append(int(buf[i + 4:j]))
        pos = j
    return buf[-3:]     # may hold the start of a stamp line split across reads


# --- client: streamquake's own read path ----------------------------------------------------


def run_streamquake(url: str, streams: int, warm_s: float, seconds: float) -> dict[str, Any]:
    import random

    import gevent

    from streamquake.loadgen import client as client_mod
    from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
    from streamquake.loadgen.sse_parser import SSEParser
    from streamquake.loadgen.tally import _Tally

    rec = Recorder(warm_s, seconds)
    handed: list[int] = []      # the stamps of the events the last feed() returned, in order
    taken = [0]

    class StampedParser(SSEParser):
        """The client's parser, also reading the stamp comments it skips (benchmark only)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.carry = b""
            self.stamps: list[int] = []

        def feed(self, data: bytes) -> list[Any]:
            events = super().feed(data)
            self.carry = _stamps(self.carry, data, self.stamps)
            # The client hands these events to _Tally.add before it reads again, and no
            # greenlet runs in between: the stamps can wait in one shared list.
            k = len(events)
            handed[:] = self.stamps[:k]
            del self.stamps[:k]
            taken[0] = 0
            return events

    original_add = _Tally.add

    def add(self: Any, event: Any, now: float, *rest: Any, **kwargs: Any) -> None:
        # ``now``: the event's arrival as the client records it (its TTFT and ITL come from
        # it; the kernel's receive stamp where it has one); ``seen``, where the client passes
        # one: when its code got to the bytes.
        stamp = handed[taken[0]]
        taken[0] += 1
        before = self.sample.content_events
        original_add(self, event, now, *rest, **kwargs)
        if self.sample.content_events != before:
            first = before == 0
            rec.content(now, stamp, getattr(self, "sq_prev", None),
                        self.t0 if first else None, self.sample.ttft_ms if first else None)
            self.sq_prev = (now, stamp)
            seen = rest[0] if rest else kwargs.get("seen")
            if seen is not None and rec.w0 <= now <= rec.w1:
                rec.seen_ns.append(rec.ns(seen) - stamp)

    setattr(client_mod, "SSEParser", StampedParser)  # noqa: B010 - the benchmark's hook
    setattr(_Tally, "add", add)  # noqa: B010

    workdir = Path(tempfile.mkdtemp(prefix="sq-sweep-"))
    plan = LoadPlan(base_url=url, protocol="openai", model=MODEL, timeout_s=60.0,
                    classes=[RequestClassPlan(prompts=["Say something."], max_tokens=64)],
                    samples_path=str(workdir), end_at=time.time() + warm_s + seconds + 60)
    cls = plan.classes[0]
    sink = open(workdir / "samples.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def user(i: int) -> None:
        gevent.sleep(STREAM_S * i / streams)
        sc = client_mod.StreamClient(plan, concurrency=1)
        rng = random.Random(i)
        try:
            while time.perf_counter() < rec.w1:
                sample = sc.measure(cls, rng)
                sink.write(sample.to_json() + "\n")    # as the locustfile's _write does
                sink.flush()
                rec.request_done(sample.error, time.perf_counter())
        finally:
            sc.close()

    def window() -> None:
        gevent.sleep(max(0.0, rec.w0 - time.perf_counter()))
        rec.mark()
        gevent.sleep(max(0.0, rec.w1 - time.perf_counter()))
        rec.mark()

    users = [gevent.spawn(user, i) for i in range(streams)]
    gevent.spawn(window).join()
    gevent.killall(users, timeout=5)
    sink.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return rec.result("streamquake", streams)


# --- client: the read loop of vLLM's benchmark_serving ----------------------------------------


def run_aiohttp(url: str, streams: int, warm_s: float, seconds: float) -> dict[str, Any]:
    import asyncio

    import aiohttp

    rec = Recorder(warm_s, seconds)
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}],
               "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}

    async def one(session: aiohttp.ClientSession) -> str | None:
        st = time.perf_counter()
        stamp = 0
        prev: tuple[float, int] | None = None
        async with session.post(url + PATH, json=payload) as response:
            if response.status != 200:
                return f"http {response.status}"
            async for chunk_bytes in response.content:
                chunk_bytes = chunk_bytes.strip()
                if not chunk_bytes:
                    continue
                chunk_str = chunk_bytes.decode("utf-8")
                if chunk_str.startswith(":"):
                    stamp = int(chunk_str[4:])       # the benchmark's addition
                    continue
                chunk = chunk_str.removeprefix("data: ")
                if chunk == "[DONE]":
                    continue
                timestamp = time.perf_counter()
                data = json.loads(chunk)
                if choices := data.get("choices"):
                    content = choices[0]["delta"].get("content")
                    if content:
                        first = prev is None
                        rec.content(timestamp, stamp, prev, st if first else None,
                                    (timestamp - st) * 1000.0 if first else None)
                        prev = (timestamp, stamp)
        return None

    async def user(session: aiohttp.ClientSession, i: int) -> None:
        await asyncio.sleep(STREAM_S * i / streams)
        while time.perf_counter() < rec.w1:
            try:
                error = await one(session)
            except (aiohttp.ClientError, OSError) as exc:
                error = type(exc).__name__
            rec.request_done(error, time.perf_counter())

    async def window() -> None:
        await asyncio.sleep(max(0.0, rec.w0 - time.perf_counter()))
        rec.mark()
        await asyncio.sleep(max(0.0, rec.w1 - time.perf_counter()))
        rec.mark()

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)   # vLLM's AIOHTTP_TIMEOUT
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks = [asyncio.create_task(user(session, i)) for i in range(streams)]
            await window()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    return rec.result("aiohttp", streams)


# --- the parent: target, clients, table ----------------------------------------------------------


def run_python_client(client: str, url: str, streams: int, warm_s: float, seconds: float,
                      target_pid: int) -> dict[str, Any]:
    cmd = ["taskset", "-c", LOAD_CORE, sys.executable, __file__, "--client", client,
           "--url", url, "--n", str(streams), "--warm", str(warm_s), "--seconds", str(seconds)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True)
    marks: list[tuple[float, float, float]] = []   # time, target CPU s, target wait s
    last = ""
    assert proc.stdout is not None
    timer = threading.Timer(warm_s + seconds + 90, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith("WINDOW"):
                marks.append((time.monotonic(), proc_cpu_s(target_pid),
                              run_delay_s(target_pid)))
            elif line.strip():
                last = line
    finally:
        timer.cancel()
        code = proc.wait()
    if code != 0 or not last.startswith("{"):
        return {"client": client, "streams": streams, "failed": f"exit code {code}"}
    result: dict[str, Any] = json.loads(last)
    if len(marks) == 2:
        span = marks[1][0] - marks[0][0]
        result["target_cpu_share"] = (marks[1][1] - marks[0][1]) / span
        result["target_wait_share"] = (marks[1][2] - marks[0][2]) / span
    return result


def _tree_cpu_s(root: Any) -> tuple[float, float]:
    """CPU and run-queue wait seconds of ``root`` and its live descendants."""
    import psutil

    cpu = wait = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            cpu += t.user + t.system
            wait += run_delay_s(p.pid)
        except (psutil.Error, OSError):
            pass
    return cpu, wait


def _at(series: list[tuple[float, float]], t: float) -> float:
    """Linear interpolation of (time, value) samples at ``t``."""
    for (ta, va), (tb, vb) in zip(series, series[1:], strict=False):
        if ta <= t <= tb:
            return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else vb
    return series[0][1] if t < series[0][0] else series[-1][1]


def run_guidellm(venv: Path, url: str, streams: int, warm_s: float, seconds: float,
                 target_pid: int, workdir: Path) -> dict[str, Any]:
    import psutil

    exe = venv / "bin" / "guidellm"
    base: dict[str, Any] = {"client": "guidellm", "streams": streams}
    if not exe.exists():
        return {**base, "failed": f"not installed ({exe} missing)"}
    data = workdir / "prompts.json"
    if not data.exists():
        data.write_text(json.dumps([{"prompt": f"Say something ({i})."} for i in range(50_000)]))
    out = workdir / f"guidellm-{streams}.json"
    out.unlink(missing_ok=True)
    cmd = ["taskset", "-c", LOAD_CORE, str(exe), "run",
           "--backend", f"kind=openai_http,target={url},model={MODEL},validate_backend=false",
           "--profile", f"kind=concurrent,streams={streams},rampup_duration={STREAM_S:.2f}",
           "--constraint", f"kind=max_duration,seconds={warm_s + seconds:g}",
           "--data", f"kind=json_file,path={data}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    log = open(workdir / f"guidellm-{streams}.log", "w", encoding="utf-8")  # noqa: SIM115
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = psutil.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, env=env)
    series: list[tuple[float, float]] = []   # epoch s, CPU s of guidellm's process tree
    waits: list[tuple[float, float]] = []    # epoch s, its run-queue wait s
    target: list[tuple[float, float]] = []
    target_waits: list[tuple[float, float]] = []
    deadline = time.monotonic() + warm_s + seconds + 240
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            break
        now = time.time()
        cpu_s, wait_s = _tree_cpu_s(proc)
        series.append((now, cpu_s))
        waits.append((now, wait_s))
        target.append((now, proc_cpu_s(target_pid)))
        target_waits.append((now, run_delay_s(target_pid)))
        time.sleep(0.2)
    log.close()
    if proc.returncode != 0 or not out.exists():
        tail = (workdir / f"guidellm-{streams}.log").read_text(errors="replace")[-400:]
        return {**base, "failed": f"exit code {proc.returncode}: {tail.strip()}"}
    bench = json.loads(out.read_text())["benchmarks"][0]
    a = bench["start_time"] + warm_s
    b = min(bench["end_time"], a + seconds)
    window = b - a
    events = 0.0
    ttft: list[float] = []
    itl: list[float] = []
    reqs = bench["requests"]
    for r in [*reqs["successful"], *reqs["incomplete"], *reqs.get("errored", [])]:
        timing = r["info"]["timings"]
        first, last = timing.get("first_token_iteration"), timing.get("last_token_iteration")
        n = r.get("output_tokens") or 0
        if first is None or n < 1:
            continue
        # Its tokens spread evenly between its first and last: count those inside the window.
        step = (last - first) / (n - 1) if n > 1 and last else 0.0
        inside = sum(1 for k in range(n) if a <= first + k * step <= b)
        events += inside
        if a <= first <= b and r.get("time_to_first_token_ms") is not None:
            ttft.append(r["time_to_first_token_ms"] - TTFT_MS)
        if inside and r.get("inter_token_latency_ms") is not None:
            itl.append(r["inter_token_latency_ms"] - ITL_MS)
    def spent(samples: list[tuple[float, float]]) -> float:
        return (_at(samples, b) - _at(samples, a)) / window if samples else float("nan")

    return {
        **base, "window_s": window, "events": events, "events_per_s": events / window,
        "cpu_share": spent(series), "wait_share": spent(waits),
        "target_cpu_share": spent(target), "target_wait_share": spent(target_waits),
        "requests": len(reqs["successful"]), "errors": {"errored": len(reqs.get("errored", []))},
        "arrival_ms": None, "ttft_err_ms": None,
        "ttft_minus_cfg_ms": quantiles(ttft),
        "itl_err_ms": quantiles(itl),   # per-request mean ITL - 20 ms: all it reports
        "processes": bench["scheduler_state"].get("num_processes"),
        "concurrency_median": (bench["metrics"]["request_concurrency"].get("total") or {})
        .get("median"),
    }


# --- the table ----------------------------------------------------------------------------------


def _ms(q: dict[str, Any] | None, *keys: str) -> str:
    if not q or q.get("n", 0) == 0:
        return "-"
    return "/".join(f"{q[k]:.2f}" if abs(q[k]) < 10 else f"{q[k]:.0f}" for k in keys)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def per_core(r: dict[str, Any]) -> float | None:
    share = r.get("cpu_share")
    return r["events_per_s"] / share if share and share > 0 else None


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| streams | client | events/s | CPU % | events/s per core | arrival err p50/p99/max "
            "ms | seen err p50/p99 ms | TTFT err p50/p99 ms | TTFT - 100 p50/p99 ms | "
            "ITL err p50/p99 ms | x aiohttp ev/s | x aiohttp ev/s/core | "
            "run-queue wait % client/target | target CPU % | errors |")
    lines = [head, "|---:|---|" + "---:|" * 13]
    peers = {(r["streams"], r["client"]): r for r in rows}
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['streams']:,} | {r['client']} | failed: "
                         f"{r['failed'][:120].replace('|', '/')} |" + " |" * 12)
            continue
        base = peers.get((r["streams"], "aiohttp")) or {"failed": "not run"}
        base_ok = "failed" not in base
        errors = sum(r.get("errors", {}).values())
        lines.append(
            f"| {r['streams']:,} | {r['client']} | {r['events_per_s']:,.0f} | "
            f"{100 * r['cpu_share']:.0f} | {per_core(r) or 0:,.0f} | "
            f"{_ms(r.get('arrival_ms'), 'p50', 'p99', 'max')} | "
            f"{_ms(r.get('seen_ms'), 'p50', 'p99')} | "
            f"{_ms(r.get('ttft_err_ms'), 'p50', 'p99')} | "
            f"{_ms(r.get('ttft_minus_cfg_ms'), 'p50', 'p99')} | "
            f"{_ms(r.get('itl_err_ms'), 'p50', 'p99')} | "
            f"{_ratio(r['events_per_s'], base['events_per_s']) if base_ok else '-'} | "
            f"{_ratio(per_core(r), per_core(base)) if base_ok else '-'} | "
            f"{100 * r.get('wait_share', float('nan')):.0f}/"
            f"{100 * r.get('target_wait_share', float('nan')):.0f} | "
            f"{100 * r.get('target_cpu_share', float('nan')):.0f} | {errors} |")
    return "\n".join(lines)


def best_under_1ms(rows: list[dict[str, Any]]) -> str:
    out = []
    for client in dict.fromkeys(r["client"] for r in rows):
        ok = [r for r in rows if r["client"] == client and "failed" not in r
              and r.get("arrival_ms") and r["arrival_ms"]["n"] and r["arrival_ms"]["p99"] <= 1.0]
        if any(r["client"] == client and "failed" not in r and not r.get("arrival_ms")
               for r in rows):
            out.append(f"- {client}: arrival error not measurable (no per-event times)")
        elif ok:
            top = max(ok, key=lambda r: r["events_per_s"])
            out.append(f"- {client}: {top['events_per_s']:,.0f} events/s at {top['streams']:,} "
                       f"streams (arrival p99 {top['arrival_ms']['p99']:.2f} ms, CPU "
                       f"{100 * top['cpu_share']:.0f}%)")
        else:
            out.append(f"- {client}: arrival p99 above 1 ms at every load measured")
    return "\n".join(out)


def machine_state() -> str:
    load = os.getloadavg()
    return (f"{platform.machine()}, {os.cpu_count()} cores, load average {load[0]:.2f} "
            f"{load[1]:.2f} {load[2]:.2f} at the start")


class FastTarget:
    """``fast_target.py`` running pinned to the target's core (``url``, ``pid``)."""

    def __init__(self, per_write: int) -> None:
        cmd = ["taskset", "-c", TARGET_CORE, sys.executable, str(ROOT / "benchmarks" /
               "fast_target.py"), "--ttft-ms", f"{TTFT_MS:g}", "--itl-ms", f"{ITL_MS:g}",
               "--tokens", str(TOKENS), "--per-write", str(per_write)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True)
        assert self.proc.stdout is not None
        timer = threading.Timer(30, self.proc.kill)     # a target that never says its URL
        timer.start()
        self.url = self.proc.stdout.readline().strip()
        timer.cancel()
        self.pid = self.proc.pid
        if not self.url.startswith("http://"):
            self.proc.kill()
            raise RuntimeError(f"fast_target.py did not start (exit code {self.proc.wait()})")

    def __enter__(self) -> FastTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    from streamquake.embedded.config import TargetConfig
    from streamquake.embedded.process import start_target

    streams = [int(s) for s in args.streams.split(",")]
    clients = [c for c in args.clients.split(",") if c]
    warm_s = STREAM_S + (0.5 if args.quick else 1.5)
    cfg = TargetConfig.model_validate({
        "protocols": ["openai"], "ttft": f"{TTFT_MS:g}ms", "itl": f"{ITL_MS:g}ms",
        "output_tokens": {"min": TOKENS, "max": TOKENS}, "capacity": 2 * max(streams) + 64,
        "stamp_send_time": True,
    })
    print(f"# streams sweep {datetime.date.today()}: {machine_state()}; target on core "
          f"{TARGET_CORE}, clients on core {LOAD_CORE}; TTFT {TTFT_MS:g} ms, ITL {ITL_MS:g} ms, "
          f"{TOKENS} tokens, closed loop, {args.seconds:g} s window after {warm_s:.1f} s warm-up; "
          f"target {args.target}" + (f", {args.per_write} events per write"
                                     if args.target == "fast" else ""), flush=True)
    rows: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="sq-sweep-"))
    try:
        with (start_target(cfg, cmd_prefix=["taskset", "-c", TARGET_CORE]) if args.target ==
              "embedded" else FastTarget(args.per_write)) as target:
            for n in streams:
                for client in clients:
                    if client == "guidellm":
                        r = run_guidellm(args.guidellm_venv, target.url, n, warm_s,
                                         args.seconds, target.pid, workdir)
                    else:
                        r = run_python_client(client, target.url, n, warm_s, args.seconds,
                                              target.pid)
                    rows.append(r)
                    print(f"  {n:>5} {client:<12} " + (
                        f"failed: {r['failed'][:200]}" if "failed" in r else
                        f"{r['events_per_s']:>9,.0f} ev/s  CPU {100 * r['cpu_share']:3.0f}%  "
                        f"arrival p99 {_ms(r.get('arrival_ms'), 'p99')} ms"), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="50,200,500,1000,2000")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per point")
    p.add_argument("--quick", action="store_true",
                   help="short profile: 3 s windows, shorter warm-up, 50,500,2000 streams")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--guidellm-venv", type=Path, default=GUIDELLM_VENV)
    p.add_argument("--json", type=Path, help="also write every row here")
    p.add_argument("--target", choices=["embedded", "fast"], default="embedded",
                   help="the embedded target, or fast_target.py (pre-encoded events, bare "
                   "asyncio: never the bottleneck)")
    p.add_argument("--per-write", type=int, default=1,
                   help="--target fast: events per write (they share its stamp)")
    p.add_argument("--client", choices=["streamquake", "aiohttp"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--warm", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        run: Callable[..., dict[str, Any]] = (
            run_streamquake if args.client == "streamquake" else run_aiohttp)
        print(json.dumps(run(args.url, args.n, args.warm, args.seconds)), flush=True)
        return
    if args.quick:
        args.seconds = min(args.seconds, 3.0)
        if args.streams == p.get_default("streams"):
            args.streams = "50,500,2000"
    rows = sweep(args)
    print()
    print(table(rows))
    print()
    print("Highest load with arrival error p99 <= 1 ms:")
    print(best_under_1ms(rows))
    for r in rows:
        if r.get("concurrency_median") is not None:
            print(f"- guidellm at {r['streams']:,} requested streams: median concurrency "
                  f"{r['concurrency_median']:,.0f}, {r.get('processes')} processes")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
