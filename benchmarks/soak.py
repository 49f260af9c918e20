"""Soak: does any streamquake process grow while a run holds many long streams for minutes?

    .venv/bin/python benchmarks/soak.py [--quick] [--concurrency 1000] [--minutes 10]
        [--itl-ms 20] [--tokens 500] [--workers 2] [--every 5] [--keep DIR]
    scripts/soak [--quick] [...]        (the same)

Loopback only, bounded in time. It starts the embedded target (``streamquake target serve
--port 0 --config FILE``, its own process) and a real ``streamquake run`` against it (closed
loop, ``--concurrency`` users with 10-50 ms think time, each stream ``--tokens`` tokens
``--itl-ms`` apart: 10 s at the defaults, 3 s with ``--quick``; Locust master and
``--workers`` workers; no faults; ``--no-watchdog``, so no lease agent is started outside the
run's tree). The scenario YAML goes into a temp dir: a warm-up long enough to spawn every
user, then baseline, fault and recovery (no fault in it) sharing the rest of ``--minutes``.

Every ``--every`` seconds it reads VmRSS of every process in the run's tree (the runner, the
Locust master and workers, found as descendants of the run through /proc) and of the target,
and counts the target's established connections (/proc/net/tcp). The window is from the first
phase's start to the last phase's end (from the run's report.json; while a Locust process was
alive, when there is none). Per process it reports RSS at 10% of that window and at its end;
its level over 10-20% of the window and over the last 10% as floor, mean and peak of the
readings, and the verdict "flat" when all three grew within 10% (single readings of a
garbage-collected process saw between a floor and transient peaks; see ``rss_table``); and the
peak after the phases (the runner's is when it reads every sample and writes the reports:
benchmarks/report_cost.py measures that). ``--keep DIR`` keeps every sample in DIR/rss.csv.
Defaults: C=1000, D=10 min; ``--quick``: C=200, D=1 min.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STREAMQUAKE = ROOT / ".venv" / "bin" / "streamquake"
FLAT_PCT = 10.0
GRACE_S = 240.0          # start-up, the in-flight streams' stop timeout, scoring and reports


@dataclass
class Track:
    label: str
    t: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def rss_mb(pid: int) -> float | None:
    status = _read(f"/proc/{pid}/status")
    m = re.search(r"^VmRSS:\s+(\d+) kB", status or "", re.M)
    return int(m.group(1)) / 1024.0 if m else None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from each process's parent in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if not stat:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def label_of(pid: int, run_pid: int, target_pid: int) -> str:
    if pid == target_pid:
        return "target"
    if pid == run_pid:
        return "runner"
    cmd = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
    if "locust" in cmd:
        if "--worker" in cmd:
            return "locust worker"
        return "locust master" if "--master" in cmd else "locust"
    if "streamquake.embedded" in cmd:
        return "target"
    return os.path.basename(cmd[0]) if cmd and cmd[0] else "?"


def established(port: int) -> int:
    """Connections in state ESTABLISHED whose local port is ``port`` (the target's side)."""
    n = 0
    want = f":{port:04X}"
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (_read(name) or "").splitlines()[1:]:
            parts = line.split()
            if len(parts) > 3 and parts[1].endswith(want) and parts[3] == "01":
                n += 1
    return n


def scenario_yaml(url: str, users: int, minutes: float, tokens: int, workers: int,
                  samples: str = "all") -> str:
    spawn = min(users, 100)
    warmup = max(15.0, users / spawn + 10.0)
    phase = max(5.0, (minutes * 60.0 - warmup) / 3.0)
    return f"""\
name: soak
description: benchmarks/soak.py, {users} long streams held for {minutes:g} min
target:
  protocol: openai
  model: sim-1
  url: {url}
  timeout: 120s
load:
  users: {users}
  spawn_rate: {spawn}
  think_time: {{min: 10ms, max: 50ms}}
  workers: {workers}
  samples: {samples}
  classes:
    - {{name: long, weight: 1, prompt: "Write a long story.", max_tokens: {tokens}}}
  seed: 3
phases: {{warmup: {warmup:g}s, baseline: {phase:g}s, fault: {phase:g}s, recovery: {phase:g}s}}
slos:
  - {{metric: error_rate, max: 1%}}
"""


def target_config(users: int, itl_ms: float, tokens: int) -> str:
    return (f"ttft: 100ms\nitl: {itl_ms:g}ms\noutput_tokens: {{min: {tokens}, max: {tokens}}}\n"
            f"capacity: {users * 2}\nseed: 3\n")


def start_target(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [str(STREAMQUAKE), "target", "serve", "--port", "0", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=open(log, "wb"), start_new_session=True,  # noqa: SIM115
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if line.startswith("LISTENING "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"the target did not start; see {log}")


def stop(proc: subprocess.Popen[bytes], sig: int, wait_s: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def soak(args: argparse.Namespace, work: Path) -> int:
    (work / "target.yaml").write_text(target_config(args.concurrency, args.itl_ms, args.tokens))
    target, url = start_target(work / "target.yaml", work / "target.log")
    port = int(url.rsplit(":", 1)[1])
    scenario = work / "soak.yaml"
    scenario.write_text(scenario_yaml(url, args.concurrency, args.minutes, args.tokens,
                                      args.workers, args.samples))
    print(f"target {url} (pid {target.pid}); scenario {scenario}; out {work / 'out'}",
          flush=True)
    run_log = open(work / "run.log", "wb")  # noqa: SIM115
    started = time.time()
    run = subprocess.Popen(
        [str(STREAMQUAKE), "run", str(scenario), "--out", str(work / "out"), "--no-watchdog"],
        stdout=run_log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    tracks: dict[int, Track] = {}
    conns: list[tuple[float, int]] = []
    load_seen: list[float] = []
    deadline = started + args.minutes * 60.0 + GRACE_S
    try:
        while run.poll() is None and time.time() < deadline:
            now = time.time() - started
            pids = [*descendants(run.pid), target.pid]
            locust_alive = False
            for pid in pids:
                mb = rss_mb(pid)
                if mb is None:
                    continue
                tr = tracks.setdefault(pid, Track(label_of(pid, run.pid, target.pid)))
                locust_alive |= tr.label.startswith("locust")
                tr.t.append(now)
                tr.rss_mb.append(mb)
            if locust_alive:
                load_seen.append(now)
            conns.append((now, established(port)))
            if args.verbose:
                print(f"  t={now:6.0f} s  conns {conns[-1][1]:5d}  " + "  ".join(
                    f"{tr.label} {tr.rss_mb[-1]:.0f}" for tr in tracks.values()
                    if tr.t and tr.t[-1] == now), flush=True)
            time.sleep(args.every)
    finally:
        timed_out = run.poll() is None
        stop(run, signal.SIGINT, 60.0)     # Ctrl-C: the run reverts, reports, and exits
        stop(target, signal.SIGTERM, 10.0)
        run_log.close()
    code = run.returncode
    print(f"run exit code {code}{' (stopped: past the time bound)' if timed_out else ''}; "
          f"{time.time() - started:.0f} s in all; log {work / 'run.log'}")
    with open(work / "rss.csv", "w", encoding="utf-8") as f:   # the raw samples, for --keep
        f.write("t_s,pid,process,rss_mb\n")
        for pid, tr in tracks.items():
            f.writelines(f"{t:.1f},{pid},{tr.label},{v:.1f}\n"
                         for t, v in zip(tr.t, tr.rss_mb, strict=True))
    report(tracks, conns, load_seen, phase_window(work / "out", started), work / "out", args)
    return code


def phase_window(out: Path, started: float) -> tuple[float, float] | None:
    """The run's phases, from its first start to its last end, in s since the run began
    (report.json has them in epoch s); None when the run wrote no report."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):
        phases = json.loads((out / "report.json").read_text())["phases"]
        return float(phases[0]["start"]) - started, float(phases[-1]["end"]) - started
    return None


def _levels(tr: Track, start: float, end: float) -> tuple[float, float, float]:
    """(floor, mean, peak) of the readings in [start, end]."""
    values = [v for t, v in zip(tr.t, tr.rss_mb, strict=True) if start <= t <= end]
    if not values:
        return (math.nan, math.nan, math.nan)
    return min(values), sum(values) / len(values), max(values)


def rss_table(tracks: dict[int, Track], lo: float, hi: float) -> str:
    """Per process: single readings at the 10% mark and the end; then the level of its RSS
    over 10-20% of the window and over its last 10%, as floor (the least reading: what it
    keeps), mean and peak. "flat" when floor, mean and peak each grew within 10%: a garbage-
    collected process saws between a floor and its transient peaks, so two single readings
    (or medians, when the saw spends about half its time at each) compare a low with a high."""
    mark = lo + 0.1 * (hi - lo)
    rows = ["| process | pid | RSS at 10% MB | RSS at end MB | growth 10%->end | "
            "10-20%: floor / mean / peak MB | last 10%: floor / mean / peak MB | "
            "growth of floor / mean / peak | verdict | after the phases, max MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for pid, tr in sorted(tracks.items(), key=lambda kv: (kv[1].label, kv[0])):
        at10 = _at(tr, mark)
        end = next((v for t, v in zip(reversed(tr.t), reversed(tr.rss_mb), strict=True)
                    if t <= hi), None)
        if at10 is None or end is None:
            continue
        early = _levels(tr, mark, lo + 0.2 * (hi - lo))
        late = _levels(tr, hi - 0.1 * (hi - lo), hi)
        growth = [(b - a) / a * 100.0 for a, b in zip(early, late, strict=True)]
        flat = all(abs(g) <= FLAT_PCT for g in growth)
        after = [v for t, v in zip(tr.t, tr.rss_mb, strict=True) if t > hi]
        rows.append(
            f"| {tr.label} | {pid} | {at10:.0f} | {end:.0f} | {(end - at10) / at10 * 100:+.1f}% | "
            f"{' / '.join(f'{v:.1f}' for v in early)} | {' / '.join(f'{v:.1f}' for v in late)} | "
            f"{' / '.join(f'{g:+.1f}%' for g in growth)} | "
            f"{'flat within 10%' if flat else 'NOT flat'} | "
            f"{f'{max(after):.0f}' if after else '-'} |")
    return "\n".join(rows)


def from_csv(path: Path) -> dict[int, Track]:
    """The tracks of a kept run (``--keep DIR`` writes DIR/rss.csv)."""
    tracks: dict[int, Track] = {}
    for line in path.read_text().splitlines()[1:]:
        t, pid, label, mb = line.split(",")
        tr = tracks.setdefault(int(pid), Track(label))
        tr.t.append(float(t))
        tr.rss_mb.append(float(mb))
    return tracks


def _at(tr: Track, t: float) -> float | None:
    return next((v for tt, v in zip(tr.t, tr.rss_mb, strict=True) if tt >= t), None)


def report(tracks: dict[int, Track], conns: list[tuple[float, int]], load_seen: list[float],
           phases: tuple[float, float] | None, out: Path, args: argparse.Namespace) -> None:
    if not load_seen:
        print("no Locust process was ever seen: nothing to report")
        return
    # The run's phases when its report says where they were, else while Locust was alive.
    lo, hi = phases if phases is not None else (load_seen[0], load_seen[-1])
    mark = lo + 0.1 * (hi - lo)
    held = sorted(n for t, n in conns if mark <= t <= hi)
    print(f"\nphases {lo:.0f}-{hi:.0f} s after the run started ({hi - lo:.0f} s"
          f"{'' if phases else ', from Locust being alive: no report.json'}); 10% mark at "
          f"{mark:.0f} s; RSS sampled every {args.every:g} s; Locust processes seen "
          f"{load_seen[0]:.0f}-{load_seen[-1]:.0f} s")
    if held:
        print(f"target's established connections from the 10% mark to the end: min {held[0]}, "
              f"median {held[len(held) // 2]}, max {held[-1]} (asked for {args.concurrency})")
    print()
    print(rss_table(tracks, lo, hi))
    summary = out / "report.json"
    if summary.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            doc = json.loads(summary.read_text())
            print("\nper phase: " + "; ".join(
                f"{p['name']} {p['stats']['requests']} requests, "
                f"error rate {p['stats'].get('error_rate') or 0:.2%}, "
                f"client saturated {p['stats'].get('client_saturated')}"
                for p in doc["phases"]))
    timeline = out / "timeline.csv"
    if timeline.exists():
        rows = timeline.read_text().splitlines()[1:]
        inflight = sorted(int(r.split(",")[4]) for r in rows if r.split(",")[1] != "warmup")
        if inflight:
            print(f"in flight per second (timeline.csv, measured phases): median "
                  f"{inflight[len(inflight) // 2]}, min {inflight[0]}, max {inflight[-1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="C=200, D=1 min")
    ap.add_argument("--concurrency", "-c", type=int, default=None, help="streams held (1000)")
    ap.add_argument("--minutes", "-d", type=float, default=None, help="run length (10)")
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens a stream (500: 10 s at 20 ms; --quick: 150, 3 s, so that its "
                    "15 s phases hold several streams each)")
    ap.add_argument("--workers", type=int, default=2, help="Locust workers (0: one process)")
    ap.add_argument("--samples", choices=("all", "none"), default="all",
                    help="load.samples: raw request lines too (all), or scorecards only")
    ap.add_argument("--every", type=float, default=5.0, help="RSS sampling period, s")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the scenario, logs and reports here (default: a temp dir, removed)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every sample")
    args = ap.parse_args()
    if args.concurrency is None:
        args.concurrency = 200 if args.quick else 1000
    if args.minutes is None:
        args.minutes = 1.0 if args.quick else 10.0
    if args.tokens is None:
        args.tokens = 150 if args.quick else 500
    if not STREAMQUAKE.exists():
        raise SystemExit(f"{STREAMQUAKE} is missing: run scripts/setup first")
    work = args.keep or Path(tempfile.mkdtemp(prefix="sq-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"soak: C={args.concurrency}, D={args.minutes:g} min, ITL {args.itl_ms:g} ms x "
          f"{args.tokens} tokens, {args.workers} workers; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    try:
        code = soak(args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    sys.exit(0 if code in (0, 1) else code)


if __name__ == "__main__":
    main()
