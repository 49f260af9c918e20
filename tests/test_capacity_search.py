"""Capacity under fault (issue 22): `streamquake capacity` finds the highest arrival rate at which
the scenario's SLOs hold, with no fault and with each fault held, through the product's own
runner against the embedded target, and reports the capacity each fault leaves.

The embedded target serves ``capacity`` streams at once, so its queue becomes unstable above
capacity / mean service time; the GPU clocks fault at 50% (through the emulated NVML driver,
tests/nvml_shim.py, which the target's gpu_clock_scale reads) doubles every delay, so halves it.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from nvml_shim import FakeGpus

from streamquake.run.capacity_search import Condition, Probe, next_probe
from tests.conftest import REPO, cli_cmd

SLOTS, TTFT_MEDIAN_S, SIGMA, ITL_S, TOKENS = 20, 0.1, 0.25, 0.1, 5
# The mean service time: a lognormal TTFT's mean, then the gaps before the other tokens.
SERVICE_S = TTFT_MEDIAN_S * math.exp(SIGMA ** 2 / 2) + (TOKENS - 1) * ITL_S
UNSTABLE = SLOTS / SERVICE_S          # requests/s: above this the queue grows without end

SCENARIO = f"""
name: capacity-under-fault
target:
  protocol: openai
  timeout: 2s
  probe: false
  embedded:
    ttft: {{dist: lognormal, median: {TTFT_MEDIAN_S * 1000:g}ms, sigma: {SIGMA}}}
    itl: {ITL_S * 1000:g}ms
    output_tokens: {{min: {TOKENS}, max: {TOKENS}}}
    capacity: {SLOTS}
    gpu_clock_scale: true
load: {{arrival: {{rate: 30, process: constant}}}}
faults:
  - {{name: half-clock, type: gpu_clocks, gpus: [0], sm_clocks: ["50%", "50%"]}}
phases: {{baseline: 5s, fault: 5s, recovery: 5s}}
slos:
  # A stream that waits in an unstable queue times out (2 s, against 0.5 s or 1 s of service).
  - {{metric: error_rate, max: 5%}}
"""


def _probe(rate: float, verdict: str) -> Probe:
    return Probe(rate, 4.0, rate, rate, verdict, "")   # type: ignore[arg-type]


def test_the_search_grows_then_bisects_and_inconclusive_narrows_nothing() -> None:
    assert next_probe([], 10, 2, 0.1) == (10, 1.0)
    assert next_probe([_probe(10, "pass")], 10, 2, 0.1) == (20, 1.0)
    assert next_probe([_probe(10, "fail")], 10, 2, 0.1) == (5, 1.0)
    bracket = [_probe(10, "pass"), _probe(20, "pass"), _probe(40, "fail")]
    step = next_probe(bracket, 10, 2, 0.1)
    assert not isinstance(step, str) and step[0] == pytest.approx(math.sqrt(20 * 40))
    assert step[1] == 1.0
    # An inconclusive probe is repeated once, longer; twice inconclusive ends the search.
    unsure = [*bracket, _probe(28, "inconclusive")]
    assert next_probe(unsure, 10, 2, 0.1) == (28, 2.0)
    said = next_probe([*unsure, _probe(28, "inconclusive")], 10, 2, 0.1)
    assert isinstance(said, str) and "inconclusive twice at 28" in said
    assert Condition("c", None, [*unsure]).low == 20     # it narrowed nothing
    assert next_probe([_probe(20, "pass"), _probe(21, "fail")], 10, 2, 0.1) == \
        "bracket within 10%"


@pytest.mark.timeout(1200)     # hang-only: about 15 probes of ~20 s on a busy 2-core machine
def test_capacity_is_where_the_queue_becomes_unstable_and_a_doubled_service_time_halves_it(
        tmp_path: Path) -> None:
    gpus = FakeGpus(tmp_path / "gpus.txt", gpu_count=1)
    spec = tmp_path / "capacity.yaml"
    spec.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = subprocess.run(
        cli_cmd("capacity", str(spec), "--warmup", "10s", "--probe", "4s", "--precision", "10%",
                "--max-probes", "14", "--budget", "15m", "--no-watchdog", "--out", str(out)),
        capture_output=True, text=True, timeout=1100, cwd=REPO,
        env=gpus.env(STREAMQUAKE_STATE_DIR=str(tmp_path / "state")))
    text = proc.stdout + proc.stderr
    print(text)
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    doc = json.loads((out / "capacity.json").read_text())
    base, slow = doc["conditions"]
    assert (base["name"], slow["name"]) == ("no fault", "half-clock")
    for cond in (base, slow):
        assert cond["low"] is not None and cond["high"] is not None, cond["sureness"]
        assert cond["high"] / cond["low"] - 1 <= 0.1 + 1e-9, cond
    assert base["estimate"] == pytest.approx(UNSTABLE, rel=0.15), (base["estimate"], UNSTABLE)
    assert slow["estimate"] == pytest.approx(UNSTABLE / 2, rel=0.15), (slow["estimate"],
                                                                       UNSTABLE / 2)
    # The reported loss agrees with the two capacities, and its interval holds it.
    (loss,) = doc["losses"]
    assert loss["fault"] == "half-clock"
    assert loss["ratio"] == pytest.approx(slow["estimate"] / base["estimate"])
    assert loss["ratio"] == pytest.approx(0.5, abs=0.12)
    assert loss["low"] <= loss["ratio"] <= loss["high"]
    assert f"capacity under half-clock: {loss['ratio']:.0%} of the no-fault capacity" in text
    # Each probe ran the real runner, and says what it sent and what came back.
    for p in base["probes"] + slow["probes"]:
        assert p["verdict"] in ("pass", "fail", "inconclusive")
        assert p["sent_per_s"] > 0 and (Path(p["out"]) / "run" / "locust.log").exists()
    html = (out / "report.html").read_text()
    assert 'data-chart="capacity-0"' in html and 'data-chart="capacity-1"' in html
    assert "throughput vs error_rate" in html
