"""Events/s that one streamquake run reads with 1, 2 and 4 Locust worker processes.

    .venv/bin/python benchmarks/workers_scaling.py [--workers 0,2,4] [--users 600] [--seconds 15]

The real thing end to end: `streamquake target serve` (TTFT 0, ITL 2 ms, 100 tokens, the
OpenAI format) and `streamquake run` of a closed-loop scenario with no think time against it,
with `load.workers` 0 (one load process), 2 and 4, one after the other (`--samples none`: no
raw request lines, scorecards only). From each run's report.json: the baseline's content
events per second (first tokens and gaps scored in the phase, over its length),
the saturation guard's figures (client CPU max, hub lag p99: run/saturation.py), and the ratio
of events/s to the single process of the same invocation. On a 2-core machine whose other core
serves the target, more processes can only share one core: the ratio then shows what extra
processes cost, not what more cores give; `--pin-target` (default on) keeps the target on
core 0 so that the load processes have the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _target(tmp: Path, pin: bool) -> tuple[subprocess.Popen[bytes], str]:
    config = tmp / "target.yaml"
    config.write_text("ttft: 0ms\nitl: 2ms\noutput_tokens: {min: 100, max: 100}\n"
                      "capacity: 100000\n")
    cmd = [PY, "-m", "streamquake", "target", "serve", "--protocol", "openai", "--port", "0",
           "--config", str(config)]
    if pin:
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if line.startswith("LISTENING "):
            return proc, line.split()[1]
    proc.kill()
    raise SystemExit("the target did not start")


def _run(tmp: Path, url: str, workers: int, users: int, seconds: float,
         samples: str) -> dict[str, object]:
    scenario = tmp / f"w{workers}.yaml"
    scenario.write_text(
        f"name: scaling-w{workers}\ntarget: {{protocol: openai, url: '{url}', timeout: 30s}}\n"
        f"load: {{users: {users}, spawn_rate: {users}, workers: {workers}, "
        f"samples: {samples}}}\n"
        f"phases: {{warmup: 5s, baseline: {seconds}s, fault: 0s, recovery: 0s}}\n")
    out = tmp / f"out-w{workers}"
    started = time.monotonic()
    proc = subprocess.run([PY, "-m", "streamquake", "run", str(scenario), "--out", str(out),
                           "--no-watchdog"], cwd=REPO, capture_output=True, text=True,
                          timeout=seconds + 180)
    took = time.monotonic() - started
    report = json.loads((out / "report.json").read_text())
    base = next(p for p in report["phases"] if p["name"] == "baseline")
    stats = base["stats"]
    client = stats.get("client", {})
    # Content events seen in the phase: every first token and every gap that happened in it.
    events = stats["ttft_ms"]["count"] + stats["itl_ms"]["count"]
    return {"workers": workers, "processes": max(1, workers), "exit": proc.returncode,
            "requests": stats["requests"], "events_per_s": events / (base["end"] - base["start"]),
            "cpu_max": client.get("cpu_pct_max"), "hub_lag_p99_ms": client.get("hub_lag_p99_ms"),
            "saturated": stats.get("client_saturated"), "wall_s": round(took, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="0,2,4", help="load.workers values (0: one process)")
    p.add_argument("--users", type=int, default=600)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--pin-target", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--samples", choices=("all", "none"), default="all",
                   help="load.samples: raw request lines too, or scorecards only")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sq-scaling-") as d:
        tmp = Path(d)
        os.environ["STREAMQUAKE_STATE_DIR"] = str(tmp / "state")
        target, url = _target(tmp, args.pin_target)
        try:
            rows = [_run(tmp, url, int(w), args.users, args.seconds, args.samples)
                    for w in args.workers.split(",")]
        finally:
            target.terminate()
            target.wait(timeout=10)
    one = rows[0]["events_per_s"]
    print(f"# {args.users} users, closed loop, ITL 2 ms x 100 tokens; "
          f"{os.cpu_count()} cores, target {'on core 0' if args.pin_target else 'unpinned'}; "
          f"load.samples {args.samples}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| load processes | events/s | vs 1 process | requests | client CPU max % | "
          "hub lag p99 ms | saturated | exit |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        ratio = r["events_per_s"] / one if one else float("nan")  # type: ignore[operator]
        print(f"| {r['processes']} | {r['events_per_s']:,.0f} | {ratio:.2f} | {r['requests']} | "
              f"{r['cpu_max']} | {r['hub_lag_p99_ms']} | {r['saturated']} | {r['exit']} |")


if __name__ == "__main__":
    main()
