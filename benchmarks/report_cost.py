"""What it costs to turn N finished requests into verdicts and reports.

    .venv/bin/python benchmarks/report_cost.py [--quick] [--n 10000,100000,1000000]
        [--loop closed|open] [--samples none|all] [--phases 30,300,300,300] [--data-dir DIR]

For each N this plays four synthetic "load processes" finishing N requests over the phases of
a scenario parsed from YAML (two request classes, global and per-class SLOs, a recovery check):
each scores its requests, in the order they ended, into its scorecard exactly as the
locustfile does (``Scorecard.add``, sealing seconds as time passes) and writes
``scorecard-<pid>.json`` as its last checkpoint would; with ``--samples all`` it also writes
the raw lines (``RequestSample.to_json()`` in ``samples-<pid>.jsonl``), as ``load.samples:
all`` does. One ``saturation-<pid>.jsonl`` line a second per process; in open loop a few
arrivals never sent. Each request: TTFB, TTFT, E2E, 40-60 inter-token gaps at full float
precision, event ids, a few errors (more in the fault phase), a few stalls. The time the
processes spent in ``Scorecard.add`` is printed per request and per event: that is what
scoring costs the load generator while it runs, spread over the run.

Then, in a fresh subprocess per N (so the peak RSS is that process's own: VmHWM), it times the
runner's own path from "Locust has finished" to "reports are on disk":

* read      ``LocustRun.scorecard`` (merge every process's scorecard; what ``Runner.run`` calls)
* score     ``run.scoring.score``                 (inside ``Runner._result``)
* verdicts  ``run.verdicts.evaluate``             (inside ``Runner._result``)
* guard     ``SaturationGuard.mark``              (inside ``Runner._result``)
* series    ``run.series.per_second`` + ``cdfs``  (inside ``Runner._result``)
* terminal  ``reports.terminal.print_result``     (what the CLI prints first)
* reports   ``reports.outputs.write_reports``     (every file; with raw samples it streams
            them into samples.csv: shown apart as ``samples.csv``)

``Runner._result`` itself is called (the stages are timed by wrapping the names it calls), so
the result is assembled exactly as a run assembles it. When the load processes have finished
the runner is the only streamquake process doing work, so its peak is the tree's.

Goal (issue 12): within 5 s and 200 MB for a run of 10^4 to 10^6 requests; ``x goal`` is
seconds / 5 and peak MB / 200.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL_S = 5.0
GOAL_MB = 200.0
LOAD_PROCESSES = 4
T0 = 1_790_000_000.0      # the first phase's start (epoch s); any fixed past time will do

SCENARIO_YAML = """\
name: report-cost
description: synthetic samples for benchmarks/report_cost.py
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: {{dist: lognormal, median: 120ms, sigma: 0.15}}
    itl: {{dist: normal, mean: 15ms, stddev: 2ms}}
    output_tokens: {{min: 40, max: 60}}
    sse_event_ids: true
  timeout: 20s
load:
{load}
  classes:
    - name: chat
      weight: 3
      prompt: "Explain SSE in one paragraph."
      max_tokens: 60
      slos: [{{metric: ttft_ms, percentile: 99, max: 500, phases: [baseline, recovery]}}]
    - name: short
      weight: 1
      prompt: "Say hi."
      max_tokens: 40
      slos: [{{metric: e2e_ms, percentile: 95, max: 2s}}]
phases: {{warmup: {warmup}s, baseline: {baseline}s, fault: {fault}s, recovery: {recovery}s}}
faults:
  - {{type: sse_proxy, name: chunk-drop, phase: fault, drop: 5%, first_event_delay: 200ms}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 350, phases: [baseline, recovery]}}
  - {{metric: itl_ms, percentile: 95, max: 60, phases: [baseline, recovery]}}
  - {{metric: ttfb_ms, percentile: 99, max: 400}}
  - {{metric: chunk_loss, max: 1%, phases: [baseline, recovery]}}
  - {{metric: error_rate, max: 1%}}
recovery: {{tolerance: 10%, metrics: [ttft_ms, itl_ms], percentile: 95, slack: 5ms}}
"""

CLOSED_LOAD = """\
  users: 1000
  spawn_rate: 100
  think_time: {min: 100ms, max: 400ms}"""
OPEN_LOAD = """\
  users: 16
  arrival: {rate: RATE/s, process: poisson, max_inflight: 4000}"""

ERRORS = (  # kind, detail, status: what the client writes for each (loadgen/client.py)
    ("truncated", "the stream ended before its final event", 200),
    ("timeout", "no complete stream within 20 s", 200),
    ("http_status", "HTTP 503: upstream overloaded", 503),
    ("connect", "connection refused", None),
)


# --- the synthetic run --------------------------------------------------------------------------


def scenario_text(phases: list[float], loop: str, n: int) -> str:
    total = sum(phases)
    load = CLOSED_LOAD if loop == "closed" else OPEN_LOAD.replace("RATE", f"{n / total:.3f}")
    warmup, baseline, fault, recovery = (f"{p:g}" for p in phases)
    return SCENARIO_YAML.format(load=load, warmup=warmup, baseline=baseline, fault=fault,
                                recovery=recovery)


def _one(rng: random.Random, sent: float, in_fault: bool, loop: str) -> Any:
    from streamquake.loadgen.samples import RequestSample

    cls = "chat" if rng.random() < 0.75 else "short"
    tokens = rng.randint(40, 60) if cls == "chat" else rng.randint(40, 50)
    ttfb = rng.lognormvariate(math.log(95.0), 0.2)
    ttft = ttfb + rng.uniform(0.5, 3.0) + (200.0 if in_fault else 0.0)
    mean_itl = 18.0 if in_fault else 15.0
    gaps = [max(0.05, rng.gauss(mean_itl, 2.0)) for _ in range(tokens - 1)]
    stalls = 0
    if rng.random() < (0.02 if in_fault else 0.002):
        i = rng.randrange(len(gaps))
        gaps[i] += rng.uniform(250.0, 900.0)
        stalls = 1
    error = None
    if rng.random() < (0.04 if in_fault else 0.004):
        error = ERRORS[rng.randrange(len(ERRORS))]
    s = RequestSample(cls=cls, sent=sent, clock="kernel")
    if loop == "open":
        s.scheduled = sent - rng.expovariate(1 / 0.0004)
    if error is not None and error[0] == "connect":
        s.e2e_ms = rng.uniform(0.2, 2.0)
    elif error is not None and error[0] == "http_status":
        s.ttfb_ms, s.e2e_ms, s.status = ttfb, ttfb + 0.4, 503
    else:
        if error is not None:    # truncated or timed out mid-stream: part of the gaps
            gaps = gaps[: rng.randrange(1, len(gaps))]
        s.status = 200
        s.ttfb_ms, s.ttft_ms, s.itl_ms = ttfb, ttft, gaps
        s.content_events = len(gaps) + 1
        s.e2e_ms = ttft + sum(gaps) + rng.uniform(0.3, 1.5)
        if error is not None and error[0] == "timeout":
            s.e2e_ms = 20_000.0
        s.output_tokens = s.content_events
        if error is None:
            s.usage_tokens = tokens
            s.output_tokens = tokens
        missing = sum(1 for _ in range(tokens) if rng.random() < 0.05) if in_fault else 0
        s.expected_events = tokens + 2 if error is None else 0
        s.missing_events = missing if error is None else 0
        s.stalls = stalls
    if error is not None:
        s.error, s.error_detail = error[0], error[1]  # type: ignore[assignment]
    return s


def generate(out: Path, n: int, phases: list[float], loop: str, seed: int,
             samples: str) -> dict[str, float]:
    """N requests over the phases, scored and written like the load processes do; returns
    what scoring cost them."""
    from streamquake.loadgen.scorecard import Scorecard
    from streamquake.run.timeline import plan_windows
    from streamquake.scenario import parse_scenario

    scenario = parse_scenario(scenario_text(phases, loop, n))
    windows = plan_windows(scenario, T0)
    run_dir = out / "run"
    samples_dir = run_dir / "samples"
    samples_dir.mkdir(parents=True, exist_ok=True)
    total = sum(phases)
    fault_start = T0 + phases[0] + phases[1]
    fault_end = fault_start + phases[2]
    rng = random.Random(seed)
    pids = [40_000 + i for i in range(LOAD_PROCESSES)]
    # Sealed seconds leave as lines (seconds-<pid>.jsonl), as the locustfile sends them.
    second_files = [open(samples_dir / f"seconds-{pid}.jsonl", "w",  # noqa: SIM115
                         encoding="utf-8") for pid in pids]
    cards = [Scorecard(windows, seal_after_s=20.0 + 15.0,
                       seconds_sink=lambda line, f=f: f.write(line + "\n"))  # type: ignore[misc]
             for f in second_files]
    scoring_s = 0.0
    events = 0
    chunk = 20_000   # requests sent in a stretch of time, written in the order they ended
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        lo = T0 + total * start / n
        hi = T0 + total * (start + count) / n
        batch = [(rng.randrange(LOAD_PROCESSES), _one(rng, s, fault_start <= s < fault_end, loop))
                 for s in sorted(rng.uniform(lo, hi) for _ in range(count))]
        batch.sort(key=lambda b: b[1].sent + (b[1].e2e_ms or 0.0) / 1000.0)
        lines: list[list[str]] = [[] for _ in pids]
        t = time.perf_counter()
        for i, s in batch:                        # what locustfile._write does
            cards[i].add(s)
        for card in cards:
            card.seal(hi)
        scoring_s += time.perf_counter() - t
        events += sum(len(s.itl_ms) + 1 for _, s in batch)
        if samples == "all":
            for i, s in batch:
                lines[i].append(s.to_json() + "\n")
            for pid, chunk_lines in zip(pids, lines, strict=True):
                with open(samples_dir / f"samples-{pid}.jsonl", "a", encoding="utf-8") as f:
                    f.writelines(chunk_lines)
    if loop == "open":
        from streamquake.loadgen.samples import UnsentArrival

        with open(samples_dir / f"unsent-{pids[0]}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(max(1, n // 10_000)):
                due = rng.uniform(fault_start, fault_end)
                u = UnsentArrival(cls="chat", scheduled=due, given_up=due + 2.0,
                                  reason="run_ended")
                cards[0].add_unsent(u)
                f.write(u.to_json() + "\n")
    t = time.perf_counter()
    for pid, card, f in zip(pids, cards, second_files, strict=True):
        f.close()
        card.write(samples_dir / f"scorecard-{pid}.json", final=True)
    checkpoint_s = time.perf_counter() - t
    for pid in pids:   # the saturation guard: one line a second per load process
        with open(run_dir / f"saturation-{pid}.jsonl", "w", encoding="utf-8") as f:
            for sec in range(int(total)):
                start_s = T0 + sec
                f.write(json.dumps({
                    "pid": pid, "start": round(start_s, 3), "end": round(start_s + 1.0, 3),
                    "cpu_pct": round(rng.uniform(20, 45), 1),
                    "lag_ms": [round(rng.uniform(0.05, 1.2), 2) for _ in range(20)],
                    "seen_max_ms": round(rng.uniform(0.5, 2.0), 3),
                    "seen": {"100": 40, "120": 300, "140": 60},
                    "kernel_reads": 400, "user_reads": 0,
                }, separators=(",", ":")) + "\n")
    return {"scoring_s": scoring_s, "events": events, "checkpoint_s": checkpoint_s}


def data_for(root: Path, n: int, phases: list[float], loop: str, seed: int,
             samples: str) -> tuple[Path, dict[str, float]]:
    """``root/<loop>-<samples>-<N>`` holding the scenario, the scorecards (and samples) and a
    manifest; reused when the manifest matches (10^6 requests take minutes to generate)."""
    out = root / f"{loop}-{samples}-{n}"
    manifest: dict[str, Any] = {"n": n, "phases": phases, "loop": loop, "seed": seed,
                                "t0": T0, "load_processes": LOAD_PROCESSES, "version": 4,
                                "samples": samples}
    mpath = out / "manifest.json"
    if mpath.exists():
        stored = json.loads(mpath.read_text())
        cost = stored.pop("cost", {})
        if stored == manifest:
            return out, cost
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t = time.perf_counter()
    cost = generate(out, n, phases, loop, seed, samples)
    (out / "scenario.yaml").write_text(scenario_text(phases, loop, n))
    mpath.write_text(json.dumps({**manifest, "cost": cost}))
    files = list((out / "run" / "samples").iterdir())
    cards = sum(p.stat().st_size for p in files if p.name.startswith(("scorecard-", "seconds-")))
    lines = sum(p.stat().st_size for p in files if p.name.startswith("samples-"))
    print(f"  generated {n:,} requests in {time.perf_counter() - t:.0f} s: scorecards and seconds "
          f"{cards / 1e6:,.2f} MB in all, raw lines {lines / 1e6:,.0f} MB", flush=True)
    return out, cost


# --- the measured child ------------------------------------------------------------------------


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


class Clock:
    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.rss: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
            self.rss[name] = _status_mb("VmRSS")

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.stage(name):
                return fn(*args, **kwargs)
        return timed


def child_pipeline(data: Path) -> dict[str, Any]:
    from rich.console import Console

    import streamquake.reports.outputs as outputs
    import streamquake.run.runner as runner_mod
    from streamquake.journal import Journal
    from streamquake.reports.terminal import print_result
    from streamquake.run.events import Events
    from streamquake.run.launcher import LocustRun
    from streamquake.run.saturation import SaturationGuard
    from streamquake.run.timeline import STARTUP_LEAD_S, plan_windows
    from streamquake.scenario import parse_scenario

    rss_imported = _status_mb("VmRSS")
    clock = Clock()
    manifest = json.loads((data / "manifest.json").read_text())
    out = data
    scenario_file = data / "scenario.yaml"
    scenario = parse_scenario(scenario_file.read_text(), str(scenario_file))
    windows = plan_windows(scenario, manifest["t0"])
    t_all = time.perf_counter()

    with clock.stage("read"):
        load = LocustRun([], [], out / "run" / "samples", windows[-1].end)
        card, problems = load.scorecard(windows)
    assert not problems, problems
    # Runner._result as the run calls it; its stages timed by wrapping the names it calls.
    for name, stage in (("score", "score"), ("evaluate", "verdicts"),
                        ("per_second", "series"), ("cdfs", "series")):
        setattr(runner_mod, name, clock.wrap(stage, getattr(runner_mod, name)))
    runner = runner_mod.Runner(scenario, str(scenario_file), out, events=Events(),
                               journal=Journal(out / "journal.json"), lease_s=None)
    runner.guard = SaturationGuard(runner.work_dir, windows, runner.events)
    runner.guard.mark = clock.wrap("guard", runner.guard.mark)  # type: ignore[method-assign]
    with clock.stage("result"):
        result = runner._result(manifest["t0"] - STARTUP_LEAD_S - 5.0, windows, card, None,
                                {}, {}, None)
    with clock.stage("terminal"):
        print_result(result, Console(file=io.StringIO(), width=140))
    for name, stage in (("write_samples_csv", "samples.csv"),
                        ("write_html", "report.html"), ("write_json", "report.json")):
        setattr(outputs, name, clock.wrap(stage, getattr(outputs, name)))
    with clock.stage("reports"):
        written, failed = outputs.write_reports(result, out)   # streams raw samples, if any
    total = time.perf_counter() - t_all
    s = clock.s
    s["assemble"] = s.pop("result") - s["score"] - s["verdicts"] - s["guard"] - s["series"]
    return {
        "n": card.records, "unsent": card.unsent, "stages_s": s, "rss_after_mb": clock.rss,
        "total_s": total, "peak_mb": _status_mb("VmHWM"), "rss_imported_mb": rss_imported,
        "written": {p.name: p.stat().st_size for p in written},
        "failed": [str(p) for p, _ in failed], "exit_code": result.exit_code,
        "checks": len(result.checks), "timeline": len(result.timeline),
    }


def run_child(kind: str, data: Path, timeout_s: float, mem_mb: int) -> dict[str, Any]:
    def limit() -> None:   # a runaway process fails with MemoryError instead of swapping the VM
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))

    proc = subprocess.run(
        [sys.executable, __file__, f"--child-{kind}", str(data)], capture_output=True,
        text=True, timeout=timeout_s, preexec_fn=limit, check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' / '.join(tail)}"}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# --- the table ---------------------------------------------------------------------------------


STAGES = ("read", "score", "verdicts", "guard", "series", "assemble", "terminal", "reports")


def print_table(rows: list[tuple[int, dict[str, Any], dict[str, float]]]) -> None:
    head = ["N", *STAGES, "total s", "peak MB", "x 5 s", "x 200 MB",
            "load-side scoring us/request", "us/event"]
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for n, res, cost in rows:
        if "error" in res:
            print(f"| {n:,} | {res['error']} |")
            continue
        st = res["stages_s"]
        cells = [f"{n:,}", *(f"{st[k]:.2f}" for k in STAGES), f"{res['total_s']:.2f}",
                 f"{res['peak_mb']:,.0f}", f"{res['total_s'] / GOAL_S:.2f}",
                 f"{res['peak_mb'] / GOAL_MB:.2f}",
                 f"{cost['scoring_s'] / n * 1e6:.1f}",
                 f"{cost['scoring_s'] / cost['events'] * 1e6:.2f}"]
        print("| " + " | ".join(cells) + " |")
    print()
    for n, res, cost in rows:
        if "error" in res:
            continue
        st = res["stages_s"]
        inner = ", ".join(f"{k} {st[k]:.2f} s" for k in
                          ("samples.csv", "report.html", "report.json") if k in st)
        rss = ", ".join(f"{k} {v:,.0f}" for k, v in res["rss_after_mb"].items()
                        if k in ("read", "result", "reports"))
        print(f"N={n:,}: reports = {inner}; RSS after import {res['rss_imported_mb']:.0f} MB, "
              f"after stage (MB): {rss}; last checkpoint of the 4 load processes "
              f"{cost['checkpoint_s']:.2f} s; files: "
              + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in res["written"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="10000,100000,1000000", help="comma-separated N")
    ap.add_argument("--quick", action="store_true", help="N = 10^4 and 10^5 only")
    ap.add_argument("--loop", choices=("closed", "open"), default="closed")
    ap.add_argument("--samples", choices=("none", "all"), default="none",
                    help="load.samples: also write raw lines (then samples.csv is written)")
    ap.add_argument("--phases", default="30,300,300,300",
                    help="warmup,baseline,fault,recovery seconds the N requests spread over")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="keep the generated samples here and reuse them (default: a temp dir, "
                    "removed)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per measured process, s")
    ap.add_argument("--mem-limit-mb", type=int, default=12_000,
                    help="address-space limit of each measured process")
    ap.add_argument("--child-pipeline", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_pipeline:
        print(json.dumps(child_pipeline(args.child_pipeline)))
        return

    ns = [10_000, 100_000] if args.quick else [int(x) for x in args.n.split(",")]
    phases = [float(x) for x in args.phases.split(",")]
    if len(phases) != 4:
        ap.error("--phases takes four numbers: warmup,baseline,fault,recovery")
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="sq-report-cost-"))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; loop {args.loop}; "
          f"samples {args.samples}; phases {args.phases} s; data in {root}", flush=True)
    rows = []
    try:
        for n in ns:
            data, cost = data_for(root, n, phases, args.loop, args.seed, args.samples)
            res = run_child("pipeline", data, args.timeout, args.mem_limit_mb)
            rows.append((n, res, cost))
            done = res.get("total_s")
            print(f"  N={n:,}: " + (f"{done:.2f} s, peak {res['peak_mb']:,.0f} MB"
                                    if done is not None else res["error"]), flush=True)
    finally:
        if args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
