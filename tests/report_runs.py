"""Real runs shared by the report tests (test_reports*.py, test_compare.py, test_history.py,
test_prometheus.py): started once per test session, all at once, through the real CLI.

* ``a`` and ``a2``: the same short quickstart-like scenario (``quick``), both passing; ``a``
  serves Prometheus metrics (scraped while it runs) and writes its final figures to
  ``<root>/a.prom`` (``--metrics-file``), ``a2`` runs against the emulated NVIDIA
  driver so it records GPU telemetry. Both append to one history store.
* ``b``: the same scenario name with the target's TTFT raised from 80 to 320 ms (an injected
  regression): breaks the TTFT SLO (exit 1); appends to the history store, started last.
* ``c``: ``a``'s scenario, interrupted by SIGINT in the fault phase (exit 130).
* ``d``: a target URL nobody listens on (exit 3, before any load).
* ``e``: a scenario file with a mistake (exit 2).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO, cli_cmd

SCENARIO = """
name: quick
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: {{dist: lognormal, median: {ttft}ms, sigma: 0.1}}
    itl: {{dist: normal, mean: 10ms, stddev: 1ms}}
    output_tokens: {{min: 20, max: 30}}
    sse_event_ids: true
    seed: 3
  timeout: 10s
load:
  users: 4
  think_time: {{min: 50ms, max: 100ms}}
  classes:
    - {{name: chat, weight: 3, prompt: "Explain SSE.", max_tokens: 30}}
    - {{name: short, weight: 1, prompt: "Say hi.", max_tokens: 20}}
  seed: 3
phases: {{warmup: 1s, baseline: 5s, fault: 5s, recovery: 5s}}
faults:
  - {{type: sse_proxy, name: chunk-drop, phase: fault, drop: 20%, first_event_delay: 300ms,
      abort: {{status: 503, probability: 10%}}, seed: 3}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 250, phases: [{ttft_phases}]}}
  - {{metric: chunk_loss, max: 2%, phases: [baseline, recovery]}}
  - {{metric: error_rate, max: 1%, phases: [baseline, recovery]}}
recovery: {{tolerance: 50%, metrics: [ttft_ms], percentile: 95, slack: 20ms}}
"""

UNREACHABLE = """
name: remote
target: {{protocol: openai, url: "http://127.0.0.1:{port}", connect_timeout: 2s}}
phases: {{baseline: 5s, fault: 0s, recovery: 5s}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 300}}
"""

BROKEN = """
name: broken
phases: {baseline: 5s}
load: {users: -1}
"""


@dataclass
class Run:
    name: str
    out: Path
    returncode: int = -1
    stdout: str = ""
    metrics_url: str | None = None
    scrapes: list[tuple[float, str]] = field(default_factory=list)   # (time, exposition text)
    listening_on: list[str] = field(default_factory=list)   # local addresses of the metrics port


@dataclass
class Runs:
    root: Path
    history: Path
    runs: dict[str, Run]

    def __getitem__(self, name: str) -> Run:
        return self.runs[name]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_while_running(proc: subprocess.Popen[str], run: Run, lines: list[str]) -> None:
    assert proc.stdout is not None
    scraper: threading.Thread | None = None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving Prometheus metrics at (http://\S+)", line)
        if m and scraper is None:
            run.metrics_url = m.group(1)
            scraper = threading.Thread(target=_scrape_loop, args=(proc, run), daemon=True)
            scraper.start()
    if scraper is not None:
        scraper.join(timeout=5)


def _listening(port: int) -> list[str]:
    """Local addresses of sockets listening on ``port``, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1])
                             if len(addr) == 8 else f"ipv6:{addr}")
    return found


def _scrape_loop(proc: subprocess.Popen[str], run: Run) -> None:
    assert run.metrics_url is not None
    run.listening_on = _listening(int(run.metrics_url.rsplit(":", 1)[1].split("/")[0]))
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(run.metrics_url, timeout=2) as resp:
                run.scrapes.append((time.time(), resp.read().decode()))
        except OSError:
            pass   # between the last phase and exit the server goes away
        time.sleep(0.5)


def _start(run: Run, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str],
                                                                   threading.Thread, list[str]]:
    proc = subprocess.Popen(cli_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=_scrape_while_running, args=(proc, run, lines), daemon=True)
    reader.start()
    return proc, reader, lines


def _wait_for_line(proc: subprocess.Popen[str], lines: list[str], text: str,
                   timeout_s: float = 180) -> bool:
    """Wait until the run has printed ``text`` (True) or ended (False); the deadline is for a
    hang, however slow a busy machine starts six runs at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(text in line for line in list(lines)):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _interrupt_in_fault(proc: subprocess.Popen[str], lines: list[str]) -> None:
    # Once the fault is in place (its phase has begun, and the run said so), not a fixed time
    # after the phase's first line.
    if _wait_for_line(proc, lines, "fault applied"):
        proc.send_signal(signal.SIGINT)


@functools.cache
def report_runs() -> Runs:
    from tests.nvml_shim import FakeGpus

    root = Path(tempfile.mkdtemp(prefix="sq-report-runs-"))
    history = root / "history.sqlite"
    files = {"fast": root / "quick.yaml", "slow": root / "quick-slow.yaml",
             "remote": root / "remote.yaml", "broken": root / "broken.yaml"}
    # The fast scenario gates TTFT in recovery only: a baseline request still waiting for its
    # first event when the fault begins gets the fault's 300 ms delay and is judged in baseline
    # (it was due there); the four users start together, so up to four such requests of ~54
    # can make baseline's p95 (CI saw 385 ms). The slow one breaks it in baseline on purpose.
    files["fast"].write_text(SCENARIO.format(ttft=80, ttft_phases="recovery"))
    files["slow"].write_text(SCENARIO.format(ttft=320, ttft_phases="baseline, recovery"))
    files["remote"].write_text(UNREACHABLE.format(port=_closed_port()))
    files["broken"].write_text(BROKEN)
    gpus = FakeGpus(root / "fake-gpu-state.txt", gpu_count=1)
    plan = {
        "a": ([str(files["fast"]), "--history", str(history), "--metrics-port", "0",
               "--metrics-file", str(root / "a.prom")], {}),
        "a2": ([str(files["fast"]), "--history", str(history)], gpus.env()),
        "c": ([str(files["fast"])], {}),
        "d": ([str(files["remote"])], {}),
        "e": ([str(files["broken"])], {}),
        "b": ([str(files["slow"]), "--history", str(history)], {}),
    }
    runs: dict[str, Run] = {}
    started: dict[str, tuple[subprocess.Popen[str], threading.Thread, list[str]]] = {}
    for name, (args, extra_env) in plan.items():
        run = runs[name] = Run(name, root / name)
        env = {**os.environ, **extra_env, "STREAMQUAKE_STATE_DIR": str(root / f"state-{name}")}
        env.pop("COLUMNS", None)   # a CI log has no COLUMNS: the reports must not need it
        if name == "b":
            # The latest run in the history store, by start time: b starts once a and a2 have
            # started their phases (however long six CLIs take to start on a busy machine).
            for earlier in ("a", "a2"):
                _wait_for_line(started[earlier][0], started[earlier][2], "phase warmup")
        started[name] = _start(run, ["run", *args, "--out", str(run.out)], env)
    _interrupt_in_fault(started["c"][0], started["c"][2])
    for name, (proc, reader, lines) in started.items():
        try:
            proc.wait(timeout=300)      # a deadline for a hang
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        runs[name].returncode = proc.returncode
        runs[name].stdout = "".join(lines)
    import atexit

    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return Runs(root, history, runs)
