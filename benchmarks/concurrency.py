"""How many concurrent open streams one load process holds, and what each costs in memory.

    .venv/bin/python benchmarks/concurrency.py [--streams 1000,2500,5000,10000] [--quick]
        [--itl-ms 300] [--tokens 100] [--seconds 15] [--json FILE] [--keep DIR]
        [--gc streamquake,interpreter]
                                                    # --quick: 500 and 2,000 streams, 40 tokens

The product path: per stream count N, `streamquake run` (the installed CLI, `--no-watchdog`, a
temp state dir) of a generated scenario, pinned with `taskset` to core 1, its embedded target
moved to core 0 as it appears (as `truth.py` does): OpenAI format, TTFT 100 ms, ITL `--itl-ms`
(a few tokens a second), `--tokens` tokens, capacity 2N, `send_log` on; N users, closed loop, no
think time, their first starts spread over one stream's length (so that N streams stay open and
their events are not all due at once); warm-up = 2.5 ramps + 5 s (a busy machine stretches the
ramp: Locust's spawning falls behind), then one measured baseline
phase of `--seconds`. The run stops by itself (each run has a deadline; the whole sweep too).

Every 0.5 s the Locust process's RSS (`/proc/PID/status` VmRSS) and its open descriptors
(`/proc/PID/fd`) are sampled. **KB/stream**: (median RSS in the window - RSS at ~0 streams) /
(open streams in the window), where "~0 streams" is the last sample before the ramp passed 1%
of N, and the open streams are the descriptors above the fewest it ever held. **events/s**:
content events the target sent in the window (its send log). **arrival err**: joined per event
to the send log (`truth.join`): when `streamquake run` dated the event minus when the target
sent it. **CPU %** of the load process and the target over the window (100 = one core), and their
**run-queue wait %** (`schedstat`: runnable but waiting for a core: other work on it).
**saturated**: the run's own saturation guard for the baseline (`client_saturated`), with its
client CPU max and hub lag p99.

``--gc``: each N under each garbage-collection policy of the load process, in turn:
``streamquake`` (``loadgen/collector.py``: no full collection unless memory asks) and
``interpreter`` (the interpreter's own thresholds, the default; ``streamquake`` sets
``STREAMQUAKE_GC=steady``). A second
table gives, for the baseline, the guard's figures (its longest GC pause, wall ms; the full
collections and the longest one's CPU ms; the longest young one's CPU ms; every collection's
CPU ms in all) and the load process's RSS growth from the window's first to last reading.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import cpu_s, run_delay_s  # noqa: E402
from truth import cmdline, descendants, join, pin, read_jsonl, streamquake_cmd  # noqa: E402

TTFT_MS = 100.0
TARGET_CORE, LOAD_CORE = 0, 1
SAMPLE_S = 0.5
SWEEP_LIMIT_S = 3600.0     # the whole sweep stops after this, whatever is left


def stream_s(itl_ms: float, tokens: int) -> float:
    return (TTFT_MS + (tokens - 1) * itl_ms) / 1000.0


def scenario(n: int, itl_ms: float, tokens: int, seconds: float, send_log: Path) -> dict[str, Any]:
    ramp = stream_s(itl_ms, tokens)
    return {
        "name": f"concurrency-{n}",
        # No probe: it streams one whole answer (a stream's length) before the load starts.
        "target": {"protocol": "openai", "timeout": f"{ramp * 2 + 30:.0f}s", "probe": False,
                   "embedded": {
            "ttft": f"{TTFT_MS:g}ms", "itl": f"{itl_ms:g}ms",
            "output_tokens": {"min": tokens, "max": tokens}, "capacity": 2 * n,
            "send_log": str(send_log)}},
        "load": {"users": n, "spawn_rate": round(n / ramp, 3), "samples": "all",
                 "classes": [{"name": "chat", "prompt": "Say something.",
                              "max_tokens": tokens}]},
        # Room for a ramp that a busy machine stretches (Locust's spawning falls behind).
        "phases": {"warmup": f"{2.5 * ramp + 5:.1f}s", "baseline": f"{seconds:g}s", "fault": "0s",
                   "recovery": "0s"},
        "slos": [{"metric": "error_rate", "max": "50%"}],   # the exit code says nothing here
    }


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(field)


class Sampler(threading.Thread):
    """Finds the target and the Locust process under ``root``; pins the target to
    TARGET_CORE; samples (time, RSS KB, open fds, CPU s, run-queue wait s) of each every
    SAMPLE_S."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.pids: dict[str, int] = {}
        self.series: dict[str, list[tuple[float, int, int, float, float]]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            if len(self.pids) < 2:
                for pid in descendants(self.root):
                    args = cmdline(pid)
                    if "target" not in self.pids and "streamquake.embedded" in args:
                        pin(pid, TARGET_CORE)
                        self.pids["target"] = pid
                    elif "load" not in self.pids and any("locust" in a for a in args) \
                            and "-f" in args:
                        self.pids["load"] = pid
            now = time.time()
            for role, pid in self.pids.items():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fds = len(os.listdir(f"/proc/{pid}/fd"))
                    self.series.setdefault(role, []).append(
                        (now, status_kb(pid, "VmRSS"), fds, cpu_s(pid), run_delay_s(pid)))
            self.halt.wait(0.1 if len(self.pids) < 2 else SAMPLE_S)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)

    def share(self, role: str, a: float, b: float, col: int = 3) -> float | None:
        """CPU (col 3) or run-queue wait (4) over [a, b], in % of one core."""
        s = [x for x in self.series.get(role, []) if a <= x[0] <= b]
        return (s[-1][col] - s[0][col]) / (s[-1][0] - s[0][0]) * 100 if len(s) > 1 else None


def memory(series: list[tuple[float, int, int, float, float]], n: int, a: float,
           b: float) -> dict[str, Any]:
    """RSS at ~0 streams and in the window, open streams, KB per stream."""
    fewest = min(x[2] for x in series)
    before = [x for x in series if x[0] < a and x[2] - fewest <= max(1, n // 100)]
    inside = [x for x in series if a <= x[0] <= b]
    if not before or not inside:
        return {}
    rss0, open0 = before[-1][1], before[-1][2] - fewest
    rss = statistics.median(x[1] for x in inside)
    opened = statistics.median(x[2] for x in inside) - fewest
    return {"rss0_mb": rss0 / 1024, "rss_mb": rss / 1024, "open_streams": opened,
            "kb_per_stream": (rss - rss0) / (opened - open0) if opened > open0 else None,
            "hwm_mb": max(x[1] for x in series) / 1024}


def run_one(work: Path, n: int, itl_ms: float, tokens: int, seconds: float,
            gc_policy: str = "streamquake") -> dict[str, Any]:
    row: dict[str, Any] = {"streams": n, "gc_policy": gc_policy,
                           "loadavg_start": os.getloadavg()[0]}
    d = work / f"n{n}-{gc_policy}"
    d.mkdir(parents=True)
    send_log = d / "send-log.jsonl"
    spec = d / "scenario.yaml"
    spec.write_text(json.dumps(scenario(n, itl_ms, tokens, seconds, send_log), indent=1))
    out = d / "out"
    env = {**os.environ, "STREAMQUAKE_STATE_DIR": str(d / "state")}
    if gc_policy == "streamquake":
        env["STREAMQUAKE_GC"] = "steady"      # loadgen/collector.py: opt-in for now
    cmd = ["taskset", "-c", str(LOAD_CORE), *streamquake_cmd(), "run", str(spec), "--out",
           str(out), "--no-watchdog"]
    limit = 4.5 * stream_s(itl_ms, tokens) + seconds + 300
    with open(d / "run.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=d, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            row["exit"] = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.terminate()
            row["exit"] = proc.wait(timeout=60)
        finally:
            sampler.stop()
    row["loadavg_end"] = os.getloadavg()[0]
    text = (d / "run.log").read_text(errors="replace")
    row["capacity_line"] = next((ln.strip() for ln in text.splitlines() if "capacity:" in ln),
                                None)
    report_path = out / "report.json"
    if not report_path.exists():
        return {**row, "failed": f"exit {row['exit']}, no report.json: {text[-600:].strip()}"}
    report = json.loads(report_path.read_text())
    base = next(p for p in report["phases"] if p["name"] == "baseline")
    a, b = base["start"], base["end"]
    stats = base.get("stats") or {}
    client = stats.get("client") or {}
    errors = stats.get("errors") or {}
    row.update({"error_kinds": {k: v for k, v in errors.items() if v},
                "saturated": stats.get("client_saturated"),
                "client_cpu_max": client.get("cpu_pct_max"),
                "hub_lag_p99_ms": client.get("hub_lag_p99_ms")})
    own = client.get("own_holds") or {}
    row["gc"] = {"pause_max_ms": client.get("gc_pause_max_ms"),
                 "full": client.get("gc_full_collections"),
                 "full_max_cpu_ms": (own.get("gc_full") or {}).get("max_cpu_ms"),
                 "young_max_cpu_ms": (own.get("gc") or {}).get("max_cpu_ms"),
                 "total_ms": sum((own.get(k) or {}).get("total_ms") or 0.0
                                 for k in ("gc", "gc_full"))}
    inside = [x for x in sampler.series.get("load", []) if a <= x[0] <= b]
    row["gc"]["rss_growth_mb"] = (inside[-1][1] - inside[0][1]) / 1024 if inside else None
    samples = read_jsonl(sorted((out / "run" / "samples").glob("samples-*.jsonl")))
    joined = join(samples, list(read_jsonl([send_log])) if send_log.exists() else [], a, b)
    row.update({k: joined[k] for k in ("events_per_s", "arrival_ms", "joined")})
    row["requests"], row["errors"] = joined["samples"], joined["errors"]    # the whole run's
    row.update(memory(sampler.series.get("load", []), n, a, b))
    row["target"] = memory(sampler.series.get("target", []), n, a, b)
    for role in ("load", "target"):
        row[f"{role}_cpu"] = sampler.share(role, a, b)
        row[f"{role}_wait"] = sampler.share(role, a, b, 4)
    return row


def marginal(a: dict[str, Any] | None, b: dict[str, Any]) -> float | None:
    """KB per stream between two rows: the growth of the load process's RSS in the window over
    the growth of its open streams (what the fixed costs of a run do not blur)."""
    if a is None or not a.get("open_streams") or not b.get("open_streams") \
            or b["open_streams"] <= a["open_streams"]:
        return None
    return float((b["rss_mb"] - a["rss_mb"]) * 1024 / (b["open_streams"] - a["open_streams"]))


def _f(v: Any, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| streams | open streams | load RSS at ~0 / in window MB | KB/stream | target "
             "KB/stream | marginal KB/stream | events/s | arrival err p50/p99/max ms | "
             "load CPU % | target CPU % | "
             "run-queue wait % load/target | "
             "saturated (client CPU max %, hub lag p99 ms) | requests / failed (whole run) | "
             "load avg |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    prev: dict[str, Any] | None = None
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['streams']:,} | failed: {r['failed'][:200]} |")
            continue
        arr = r.get("arrival_ms") or {}
        lines.append(
            f"| {r['streams']:,} | {_f(r.get('open_streams'))} | "
            f"{_f(r.get('rss0_mb'), '.0f')} / {_f(r.get('rss_mb'), '.0f')} | "
            f"{_f(r.get('kb_per_stream'), '.1f')} | {_f(r['target'].get('kb_per_stream'), '.1f')}"
            f" | {_f(marginal(prev, r), '.1f')} | {_f(r.get('events_per_s'))} | "
            f"{_f(arr.get('p50'), '.2f')}/{_f(arr.get('p99'), '.1f')}/{_f(arr.get('max'), '.0f')}"
            f" | {_f(r.get('load_cpu'))} | {_f(r.get('target_cpu'))} | "
            f"{_f(r.get('load_wait'))}/{_f(r.get('target_wait'))} | "
            f"{'yes' if r.get('saturated') else 'no'} ({_f(r.get('client_cpu_max'))}, "
            f"{_f(r.get('hub_lag_p99_ms'), '.1f')}) | {_f(r.get('requests'))} / "
            f"{_f(r.get('errors'))} | {r['loadavg_start']:.1f}-{r['loadavg_end']:.1f} |")
        prev = r
    return "\n".join(lines)


def gc_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| streams | GC policy | longest GC pause ms (wall) | full collections | longest "
             "full ms CPU | longest young ms CPU | GC total ms (wall) | load RSS growth in "
             "window MB | load avg |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = r.get("gc")
        if g is None:
            continue
        lines.append(
            f"| {r['streams']:,} | {r['gc_policy']} | {_f(g['pause_max_ms'], '.1f')} | "
            f"{_f(g['full'])} | {_f(g['full_max_cpu_ms'], '.1f')} | "
            f"{_f(g['young_max_cpu_ms'], '.1f')} | {_f(g['total_ms'])} | "
            f"{_f(g['rss_growth_mb'], '+.1f')} | "
            f"{r['loadavg_start']:.1f}-{r['loadavg_end']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default=None, help="stream counts (default 1000,2500,5000,10000)")
    p.add_argument("--quick", action="store_true", help="500 and 2,000 streams, 40 tokens, 8 s")
    p.add_argument("--itl-ms", type=float, default=300.0)
    p.add_argument("--tokens", type=int, default=None, help="per stream (default 100)")
    p.add_argument("--seconds", type=float, default=None, help="the window (default 15)")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", type=Path, help="keep the runs' folders here")
    p.add_argument("--gc", default="streamquake",
                   help="the load process's GC policies, each N under each in turn")
    args = p.parse_args()
    streams = [int(s) for s in (args.streams or ("500,2000" if args.quick else
                                                 "1000,2500,5000,10000")).split(",")]
    tokens = args.tokens or (40 if args.quick else 100)
    seconds = args.seconds or (8.0 if args.quick else 15.0)
    print(f"# {platform.machine()}, {os.cpu_count()} cores; ITL {args.itl_ms:g} ms x {tokens} "
          f"tokens ({stream_s(args.itl_ms, tokens):.1f} s streams), window {seconds:g} s; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sq-concurrency-")) if args.keep is None else args.keep
    try:
        for n in streams:
            if time.monotonic() - started > SWEEP_LIMIT_S:
                print(f"# sweep time limit reached: {n:,} streams and above not run")
                break
            for policy in args.gc.split(","):
                rows.append(run_one(work, n, args.itl_ms, tokens, seconds, policy))
                r = rows[-1]
                print(f"# {n:,} ({policy} GC): {r.get('capacity_line')}", flush=True)
                print(table([r]).splitlines()[-1], flush=True)
                print(gc_table([r]).splitlines()[-1], flush=True)
    finally:
        if args.keep is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    print(gc_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
