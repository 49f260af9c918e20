"""Time to recovery on clean runs (issue 30): does a run with no real fault ever read "not
recovered", or break a ``recovery_time_s`` SLO?

    .venv/bin/python benchmarks/recovery_aa.py run DIR [--runs 22] [--busy-every 4]
        [--busy-loops 1] [--rate 8] [--recovery-s 20]
    .venv/bin/python benchmarks/recovery_aa.py table DIR

``run`` runs one scenario again and again through the product path, ``streamquake run FILE --out
DIR/runs/NN`` (Locust, open-loop Poisson arrivals, the embedded target behind the SSE proxy), one
run at a time: a baseline step, a fault step whose fault does nothing that matters (``sse_proxy``
with ``drop: 0%`` and ``first_event_delay: 1ms``, the clean runs of the issue), and a recovery
step, with ``recovery_time_s max 5s`` and the default recovery metrics (TTFT and ITL p95 within
10% + 5 ms of baseline). Every ``--busy-every``-th run has a competing load: ``--busy-loops``
processes spinning for the whole run. ``DIR/runs.jsonl`` records each run: busy, the load
average at its start, exit code, the time to recovery as the run reported it, its SLO check,
and, for contrast, what the rule before issue 30 made of the same samples (2 s windows by when
requests were due, each with at least 5 values whose nearest-rank p95 is within the limit; only
measurements that ended within the recovery step).

``table`` prints the Markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamquake.loadgen.samples import RequestSample  # noqa: E402

SCENARIO = """
name: recovery-aa
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: {{dist: lognormal, median: 40ms, sigma: 0.2}}
    itl: {{dist: normal, mean: 10ms, stddev: 1ms}}
    output_tokens: {{min: 20, max: 20}}
    seed: 3
  timeout: 10s
load:
  arrival: {{rate: {rate:g}/s, process: poisson}}
  seed: 3
faults:
  - {{type: sse_proxy, name: noop, drop: 0%, first_event_delay: 1ms}}
steps:
  - {{name: warm, kind: warmup, duration: 2s}}
  - {{name: base, kind: baseline, duration: 15s}}
  - {{name: blip, kind: fault, duration: 4s, faults: [noop]}}
  - {{name: back, kind: recovery, duration: {recovery_s:g}s}}
slos:
  - {{metric: recovery_time_s, max: 5s}}
recovery: {{tolerance: 10%, metrics: [ttft_ms, itl_ms], percentile: 95, slack: 5ms, window: 2s}}
"""


def _samples(out: Path) -> list[RequestSample]:
    return [RequestSample.from_dict(json.loads(line))
            for path in sorted((out / "run" / "samples").glob("samples-*.jsonl"))
            for line in path.read_text().splitlines() if line]


def old_rule(samples: list[RequestSample], start: float, end: float, reverted_at: float,
             limits: dict[str, float]) -> float | None:
    """The time to recovery by the rule before issue 30 (run/recovery_time.py at 8640fd0): the
    start of the first 2 s window (starts 0.2 s apart) from which every later window holds at
    least 5 values of each metric with a nearest-rank p95 within its limit; None: not recovered.
    A measurement counted only if it ended within the recovery step."""
    begin = max(reverted_at, start)
    mine = sorted((s for s in samples if not s.retried and begin <= (s.scheduled or s.sent) < end),
                  key=lambda s: s.scheduled or s.sent)
    due = [s.scheduled or s.sent for s in mine]

    def values(s: RequestSample, metric: str) -> list[float]:
        if s.ttft_ms is None:
            return []
        first = s.sent + s.ttft_ms / 1000.0
        if metric == "ttft_ms":
            return [s.ttft_ms] if first <= end else []
        out, t = [], first
        for gap in s.itl_ms:
            t += gap / 1000.0
            if t <= end:
                out.append(gap)
        return out

    per = [{m: values(s, m) for m in limits} for s in mine]
    starts = [begin + k * 0.2 for k in range(int((end - 2.0 - begin) / 0.2 + 1e-9) + 1)]

    def within(t: float) -> bool:
        lo, hi = bisect.bisect_left(due, t), bisect.bisect_left(due, t + 2.0)
        for metric, limit in limits.items():
            seen = sorted(v for vs in per[lo:hi] for v in vs[metric])
            if len(seen) < 5 or seen[max(1, math.ceil(0.95 * len(seen) - 1e-9)) - 1] > limit:
                return False
        return True

    back = None
    for t in reversed(starts):
        if not within(t):
            break
        back = t
    return None if back is None else round(back - reverted_at, 3)


def run(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    scenario = root / "recovery-aa.yaml"
    scenario.write_text(SCENARIO.format(rate=args.rate, recovery_s=args.recovery_s))
    log = root / "runs.jsonl"
    done = len(log.read_text().splitlines()) if log.exists() else 0
    for n in range(done, args.runs):
        busy = args.busy_every > 0 and n % args.busy_every == args.busy_every - 1
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(args.busy_loops if busy else 0)]
        load = os.getloadavg()[0]
        out = root / "runs" / f"{n:02d}"
        began = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "streamquake", "run", str(scenario),
                                   "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        (out / "stderr.txt").write_text(proc.stderr)
        if not (out / "report.json").exists():       # the run itself failed: say so, go on
            row0 = {"run": n, "busy": busy, "load": round(load, 2), "exit": proc.returncode,
                    "failed": proc.stderr.strip().splitlines()[-1:] or [""]}
            with log.open("a") as f:
                f.write(json.dumps(row0) + "\n")
            print(json.dumps(row0), flush=True)
            continue
        report = json.loads((out / "report.json").read_text())
        [rt] = report["recovery_times"]
        [check] = [c for c in report["checks"] if c["metric"] == "recovery_time_s"]
        phases = {p["name"]: p for p in report["phases"]}
        limits = {k: v for k, v in rt["limits"].items() if v is not None}
        old = old_rule(_samples(out), phases["back"]["start"], phases["back"]["end"],
                       rt["reverted_at"], limits)
        row: dict[str, Any] = {
            "run": n, "busy": busy, "load": round(load, 2), "exit": proc.returncode,
            "wall_s": round(time.monotonic() - began, 1),
            "time_s": rt["time_s"], "earliest_s": rt["earliest_s"], "latest_s": rt["latest_s"],
            "not_recovered": rt["not_recovered"], "why": rt["why"], "requests": rt["requests"],
            "check_passed": check["passed"], "check_inconclusive": check["inconclusive"],
            "check_not_judged": check.get("not_judged"), "old_time_s": old,
            "limits": rt["limits"]}
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _own(r: dict[str, Any]) -> str:
    """The SLO's verdict from the time's interval alone (run/verdicts.py check_recovery_time),
    whether or not the saturation guard left the run's timings unjudged."""
    if r["not_recovered"] or (r["earliest_s"] is not None and r["earliest_s"] > 5.0):
        return "broken"
    if r["latest_s"] is not None and r["latest_s"] <= 5.0:
        return "met"
    return "inconclusive"


def table(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in (Path(args.dir) / "runs.jsonl").read_text().splitlines()]
    for r in rows:
        if "failed" in r:
            print(f"run {r['run']} did not finish (exit {r['exit']}): {r['failed'][0]}")
    rows = [r for r in rows if "failed" not in r]
    print("| run | busy | load avg | exit | time to recovery (s) | interval (s) | SLO max 5 s "
          "| its own verdict | old rule (s) |")
    print("|---:|:---:|---:|---:|---|---|---|---|---|")
    for r in rows:
        if r["not_recovered"]:
            seen = "not recovered"
        elif r["time_s"] is None:
            seen = "unknown"
        else:
            seen = _s(r["time_s"])
        interval = "-" if r["not_recovered"] else \
            f"{_s(r['earliest_s'])}-{'?' if r['latest_s'] is None else _s(r['latest_s'])}"
        slo = ("not judged" if r["check_not_judged"] else
               ("met" if r["check_passed"] else "broken") +
               (" ?" if r["check_inconclusive"] else ""))
        own = _own(r)
        old = "not recovered" if r["old_time_s"] is None else _s(r["old_time_s"])
        old += " (breaks)" if r["old_time_s"] is None or r["old_time_s"] > 5.0 else ""
        print(f"| {r['run']} | {'yes' if r['busy'] else ''} | {r['load']:.1f} | {r['exit']} "
              f"| {seen} | {interval} | {slo} | {own} | {old} |")
    n = len(rows)
    nr = sum(r["not_recovered"] for r in rows)
    broke = sum(not r["check_passed"] and not r["check_not_judged"] for r in rows)
    own_broke = sum(_own(r) == "broken" for r in rows)
    unknown = sum(r["time_s"] is None and not r["not_recovered"] for r in rows)
    old_bad = sum(r["old_time_s"] is None or r["old_time_s"] > 5.0 for r in rows)
    late = [r["time_s"] for r in rows if r["time_s"] is not None]
    print(f"\n{n} runs: not recovered {nr}, SLO broken {broke} (by its own verdict, what the "
          f"saturation guard left unjudged included: {own_broke}), unknown {unknown}, "
          f"inconclusive {sum(r['check_inconclusive'] for r in rows)}, not judged "
          f"{sum(bool(r['check_not_judged']) for r in rows)}; time to recovery max "
          f"{max(late, default=0.0):.1f} s; the old rule: not recovered or over 5 s in "
          f"{old_bad}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--runs", type=int, default=22)
    r.add_argument("--busy-every", type=int, default=4)
    r.add_argument("--busy-loops", type=int, default=1)
    r.add_argument("--rate", type=float, default=8.0)
    r.add_argument("--recovery-s", type=float, default=20.0)
    t = sub.add_parser("table")
    t.add_argument("dir")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    main()
