"""The live view counts the streams in flight (issue 34): while every stream of a fault step
hangs, no request ends, and the view said "0.0 req/s | errors - | n=0" as if the load had
stopped. Now each line says how many are in flight, from the load processes' own count."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import assert_run_ended

SCENARIO = """
name: hang
target:
  protocol: openai
  embedded: {ttft: 50ms, itl: 5ms, output_tokens: {min: 10, max: 10}}
  timeout: 20s
load: {users: 4, spawn_rate: 100, think_time: {min: 10ms, max: 20ms}}
phases: {warmup: 2s, baseline: 6s, fault: 12s, recovery: 4s}
faults:
  - {type: sse_proxy, name: hold, phase: fault, first_event_delay: 10s}
slos:
  - {metric: error_rate, max: 100%}
"""


@pytest.mark.timeout(180)
def test_the_live_line_counts_streams_in_flight_while_none_ends(tmp_path: Path) -> None:
    scenario = tmp_path / "hang.yaml"
    scenario.write_text(SCENARIO)
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), timeout=150)
    assert_run_ended(proc)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("live: phase ")]
    flying = [(ln.split()[2], float(m[1]), None if m[2] == "-" else int(m[2]))
              for ln in lines if (m := re.search(r"\| ([\d.]+) req/s \| in flight (\S+) \|",
                                                 ln))]
    assert flying and len(flying) == len(lines), lines
    # In the fault step the first 10 s end nothing, yet the 4 users' streams are in flight.
    hung = [n for phase, per_s, n in flying if phase == "fault" and per_s == 0.0]
    assert hung and all(n is not None and n >= 3 for n in hung), flying
