"""A/A study: do ``streamquake history`` and ``compare`` cry wolf on identical runs, and do they
still find a real regression?

    .venv/bin/python benchmarks/aa_study.py run DIR [--runs 24] [--regressed 6] [--busy-every 3]
        [--busy-loops 2] [--phase-s 4] [--users 4] [--tree CHECKOUT]
    .venv/bin/python benchmarks/aa_study.py judge DIR [--history 10/5 5/3] [--draws 60]
        [--pair-draws 20] [--scale sd|mad]

``run`` runs one short scenario again and again with ``streamquake run FILE --out DIR/runs/NN
--history DIR/history.sqlite`` (the product path: Locust, the embedded target, an SSE-proxy
fault, the saturation guard), one run at a time, ``--runs`` of them as written (the A runs) and
``--regressed`` with the embedded target's first-token delay raised 30% (80 -> 104 ms median,
the injected regression: a scenario file of the same name), spread among them (every fifth run
from the sixth on). Every ``--busy-every``-th run has a competing load: ``--busy-loops``
processes spinning ``while True: pass`` for the whole run (on this shared 2-core machine, where
other work runs too). ``DIR/runs.jsonl`` records each run: kind, busy, load average at its start,
exit code, which phases the guard marked saturated.

``judge`` feeds the runs to the judgements, through the same functions the commands use:

* ``history``: each A run, as the latest, against the A runs before it (``check_latest``: the
  ``--window`` before it, ``--min-runs`` needed); each regressed run against the A runs before
  it. A false regression: an A run flagged. Found: a regressed run flagged on TTFT.
* ``compare`` with several runs per side: ``--draws`` seeded draws of N A runs against M other
  A runs (false regressions), and of N A runs against M regressed runs (found: TTFT worse), for
  3 -- 3, 5 -- 1 and 3 -- 1.
* ``compare A B``, one run a side, by the requests within each run (``--min-runs 1``: the old
  judgement), on ``--pair-draws`` pairs of A runs: for contrast.

It prints a Markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCENARIO = """
name: aa-study
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: {{dist: lognormal, median: {ttft_ms}ms, sigma: 0.1}}
    itl: {{dist: normal, mean: 10ms, stddev: 1ms}}
    output_tokens: {{min: 20, max: 30}}
    sse_event_ids: true
    seed: 3
  timeout: 10s
load:
  users: {users}
  think_time: {{min: 50ms, max: 100ms}}
  classes:
    - {{name: chat, weight: 3, prompt: "Explain SSE.", max_tokens: 30}}
    - {{name: short, weight: 1, prompt: "Say hi.", max_tokens: 20}}
  seed: 3
phases: {{warmup: 1s, baseline: {p}s, fault: {p}s, recovery: {p}s}}
faults:
  - {{type: sse_proxy, name: chunk-drop, phase: fault, drop: 20%, first_event_delay: 300ms,
      seed: 3}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 250, phases: [baseline, recovery]}}
  - {{metric: error_rate, max: 1%, phases: [baseline, recovery]}}
recovery: {{tolerance: 50%, metrics: [ttft_ms], percentile: 95, slack: 20ms}}
"""
TTFT_MS, REGRESSED_TTFT_MS = 80, 104          # +30%


def _plan(runs: int, regressed: int) -> list[str]:
    """The order of the runs: A runs, with the regressed ones every fifth from the sixth on."""
    kinds = ["A"] * runs
    at = 5
    for _ in range(regressed):
        kinds.insert(min(at, len(kinds)), "R")
        at += 5
    return kinds


def _busy(loops: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(loops)]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def collect(args: argparse.Namespace) -> None:
    root: Path = args.dir
    root.mkdir(parents=True, exist_ok=True)
    files = {"A": root / "aa-study.yaml", "R": root / "aa-study-regressed.yaml"}
    files["A"].write_text(SCENARIO.format(ttft_ms=TTFT_MS, p=args.phase_s, users=args.users))
    files["R"].write_text(SCENARIO.format(ttft_ms=REGRESSED_TTFT_MS, p=args.phase_s,
                                          users=args.users))
    log = root / "runs.jsonl"
    done = len(log.read_text().splitlines()) if log.exists() else 0
    tree = (args.tree or ROOT).resolve()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for i, kind in enumerate(_plan(args.runs, args.regressed)):
        if i < done:
            continue            # resumed: these ran already
        busy = args.busy_every > 0 and i % args.busy_every == args.busy_every - 1
        out = root / "runs" / f"{i:02d}"
        loops = _busy(args.busy_loops) if busy else []
        load = os.getloadavg()[0]
        started = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "streamquake", "run", str(files[kind]),
                                   "--out", str(out), "--history", str(root / "history.sqlite")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=300, cwd=tree, env=env, check=False)
        finally:
            _stop(loops)
        (root / "runs" / f"{i:02d}.log").write_text(proc.stdout)
        try:
            report = json.loads((out / "report.json").read_text())
        except OSError:
            report = {"phases": []}         # said in the record: no report (see its log)
        saturated = [p["name"] for p in report["phases"]
                     if p["stats"].get("client_saturated") is True]
        record = {"i": i, "kind": kind, "busy": busy, "load1": round(load, 2),
                  "load1_end": round(os.getloadavg()[0], 2), "exit": proc.returncode,
                  "seconds": round(time.time() - started, 1), "saturated": saturated,
                  "out": str(out), "report": bool(report["phases"])}
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


# --- judge -------------------------------------------------------------------------------------


def _records(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "runs.jsonl").read_text().splitlines()
            if line.strip()]


def _share(k: int, n: int) -> str:
    return f"{k} of {n} ({100.0 * k / n:.0f}%)" if n else "-"


def _on_ttft(keys: list[str]) -> bool:
    return any(".ttft_ms." in key or " ttft_ms" in key for key in keys)


def judge_history(root: Path, records: list[dict[str, Any]], window: int, min_runs: int,
                  tolerance: float) -> dict[str, Any]:
    from streamquake.reports.history import check_latest, read_runs

    kind = {str(Path(r["out"]) / "report.json"): r["kind"] for r in records}
    stored = read_runs(root / "history.sqlite")
    out: dict[str, Any] = {"a_judged": 0, "a_flagged": [], "a_not_judged": 0, "r_judged": 0,
                           "r_found": 0, "r_flagged": 0, "phases_not_judged": 0,
                           "r_ttft_judged": 0}
    for i, run in enumerate(stored):
        earlier = [r for r in stored[:i] if kind.get(r.report) == "A"]
        judged = check_latest([*earlier, run], window, tolerance, min_runs)
        if judged.not_judged is not None:
            key = "a_not_judged" if kind.get(run.report) == "A" else "r_not_judged"
            out[key] = out.get(key, 0) + 1
            continue
        out["phases_not_judged"] += sum("timings not judged" in n for n in judged.notes)
        keys = [f.key for f in judged.worse]
        if kind.get(run.report) == "A":
            out["a_judged"] += 1
            if keys:
                out["a_flagged"].append((run.id, keys))
        else:
            out["r_judged"] += 1
            out["r_found"] += _on_ttft(keys)
            out["r_flagged"] += bool(keys)
            out["r_ttft_judged"] += _on_ttft([f.key for f in judged.flags])
    return out


def judge_compare(records: list[dict[str, Any]], draws: int, n_a: int, n_b: int,
                  min_runs: int, tolerance: float, seed: int) -> dict[str, Any]:
    from streamquake.reports.compare import compare_runs
    from streamquake.reports.saved_run import load_run

    rng = random.Random(seed)
    a_ids = [r["out"] for r in records if r["kind"] == "A" and r["report"]]
    r_ids = [r["out"] for r in records if r["kind"] == "R" and r["report"]]
    loaded = {out: load_run(Path(out)) for out in [*a_ids, *r_ids]}
    out: dict[str, Any] = {"aa": 0, "aa_flagged": [], "ar": 0, "ar_found": 0, "ar_flagged": 0,
                           "ar_ttft_judged": 0}
    for _ in range(draws):
        picked = rng.sample(a_ids, n_a + n_b)
        c = compare_runs([loaded[p] for p in picked[:n_a]],
                         [loaded[p] for p in picked[n_a:]], tolerance=tolerance,
                         min_runs=min_runs, resamples=1000)
        out["aa"] += 1
        if c.worse:
            out["aa_flagged"].append([f"{r.phase} {r.name}" for r in c.worse])
        if len(r_ids) >= n_b:
            c = compare_runs([loaded[p] for p in rng.sample(a_ids, n_a)],
                             [loaded[p] for p in rng.sample(r_ids, n_b)],
                             tolerance=tolerance, min_runs=min_runs, resamples=1000)
            out["ar"] += 1
            out["ar_found"] += _on_ttft([f"{r.phase} {r.name}" for r in c.worse])
            out["ar_flagged"] += bool(c.worse)
            out["ar_ttft_judged"] += _on_ttft([f"{r.phase} {r.name}" for r in c.rows
                                               if r.verdict in ("worse", "same", "better")])
    return out


def _robust_spread(*sides: Sequence[float]) -> float | None:
    """The alternative not taken (``--scale mad``): 1.4826 x the median absolute deviation of
    each side's values from its median, pooled over the sides with two values or more."""
    deviations = [abs(v - statistics.median(side)) for side in sides if len(side) >= 2
                  for v in side]
    return 1.4826 * statistics.median(deviations) if deviations else None


def judge(args: argparse.Namespace) -> None:
    if args.scale == "mad":
        import streamquake.reports.between_runs as between_runs

        between_runs.spread = _robust_spread
    records = _records(args.dir)
    a = [r for r in records if r["kind"] == "A"]
    loads = [r["load1"] for r in records]
    print(f"{len(records)} runs ({len(a)} A, {len(records) - len(a)} regressed); "
          f"{sum(r['busy'] for r in records)} with busy loops; load average (1 min) "
          f"at their starts {min(loads):.1f}-{max(loads):.1f}, median "
          f"{statistics.median(loads):.1f}; phases marked saturated: "
          f"{sum(len(r['saturated']) for r in records)} in "
          f"{sum(bool(r['saturated']) for r in records)} runs; exit codes "
          f"{dict(collections.Counter(r['exit'] for r in records))}")
    rows = ["| judgement | settings | A/A judged | false regressions | +30% TTFT runs | TTFT "
            "judged in one phase or more | found (on TTFT) |", "|---|---|---:|---:|---:|---:|---:|"]
    for window, min_runs in args.history:
        h = judge_history(args.dir, records, window, min_runs, args.tolerance)
        rows.append(f"| `history` (each run against the runs before it) | --window {window} "
                    f"--min-runs {min_runs} | {h['a_judged']} | "
                    f"{_share(len(h['a_flagged']), h['a_judged'])} | {h['r_judged']} | "
                    f"{h['r_ttft_judged']} | {_share(h['r_found'], h['r_judged'])} |")
        for run_id, keys in h["a_flagged"]:
            print(f"  history w{window}/m{min_runs}: A run {run_id} flagged on {', '.join(keys)}")
    for n_a, n_b, min_runs in ((3, 3, 3), (5, 1, 3), (3, 1, 3), (1, 1, 1)):
        c = judge_compare(records, args.draws if n_a > 1 else args.pair_draws, n_a, n_b,
                          min_runs, args.tolerance, args.seed)
        how = (f"`compare` {n_a} runs of A -- {n_b} of B (between runs)" if n_a > 1 else
               "`compare A B --min-runs 1` (within one run a side)")
        rows.append(f"| {how} | {c['aa']} seeded draws | {c['aa']} | "
                    f"{_share(len(c['aa_flagged']), c['aa'])} | {c['ar']} | "
                    f"{c['ar_ttft_judged']} | {_share(c['ar_found'], c['ar'])} |")
        for keys in c["aa_flagged"]:
            print(f"  compare {n_a} -- {n_b}: flagged {', '.join(keys)}")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="collect the runs")
    run.add_argument("dir", type=Path)
    run.add_argument("--runs", type=int, default=24)
    run.add_argument("--regressed", type=int, default=6)
    run.add_argument("--busy-every", type=int, default=3)
    run.add_argument("--busy-loops", type=int, default=2)
    run.add_argument("--phase-s", type=int, default=4)
    run.add_argument("--users", type=int, default=4)
    run.add_argument("--tree", type=Path, help="run streamquake from this checkout (a git "
                     "worktree of one commit, so that edits to the repository during the study "
                     "do not reach its runs); default: this one")
    jd = sub.add_parser("judge", help="judge the runs")
    jd.add_argument("dir", type=Path)
    jd.add_argument("--history", type=lambda t: tuple(int(x) for x in t.split("/")),
                    nargs="+", default=[(10, 5), (5, 3)],
                    help="WINDOW/MIN_RUNS settings of history to try")
    jd.add_argument("--draws", type=int, default=60)
    jd.add_argument("--pair-draws", type=int, default=20)
    jd.add_argument("--tolerance", type=float, default=0.10)
    jd.add_argument("--seed", type=int, default=1)
    jd.add_argument("--scale", choices=("sd", "mad"), default="sd",
                    help="the runs' spread: their standard deviation (what the commands use) "
                    "or, to see why not, their median absolute deviation")
    args = ap.parse_args()
    if args.cmd == "run":
        collect(args)
    else:
        judge(args)


if __name__ == "__main__":
    main()
