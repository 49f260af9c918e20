"""The load process's own bookkeeping never holds the gevent hub long, and the saturation
guard catches a process whose hub freezes now and then: real runs of ``streamquake run``
(Locust, scorecards, the guard, samples) against the embedded target.

Everything asserted here is measured by the guard itself (loadgen/holds.py, in the load
process's CPU time, which a busy shared machine does not stretch), so no test here has a
wall-clock threshold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from streamquake.loadgen.holds import FREEZE_ENV, LIMIT_S
from tests.conftest import run_cli
from tests.helpers import assert_run_ended

CLASSES = 100


def _scenario(tmp_path: Path, classes: int, baseline_s: int) -> Path:
    names = "\n".join(f"    - {{name: c{i}, weight: 1, max_tokens: 20}}" for i in range(classes))
    path = tmp_path / "holds.yaml"
    path.write_text(f"""
name: holds
target:
  protocol: openai
  embedded:
    ttft: {{dist: fixed, value: 20ms}}
    itl: {{dist: fixed, value: 5ms}}
    output_tokens: {{min: 20, max: 20}}
    capacity: 128
  timeout: 10s
load:
  users: 40
  spawn_rate: 40
  think_time: {{min: 0ms, max: 10ms}}
  classes:
{names}
phases: {{warmup: 2s, baseline: {baseline_s}s, fault: 1s, recovery: 1s}}
slos:
  - {{metric: error_rate, max: 100%}}
""")
    return path


def _run(tmp_path: Path, scenario: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = tmp_path / "out"
    done = run_cli("run", str(scenario), "--out", str(out), env={**os.environ, **(env or {})},
                   timeout=240)
    assert_run_ended(done)
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def _phase(report: dict[str, Any], name: str) -> dict[str, Any]:
    phase: dict[str, Any] = next(p for p in report["phases"] if p["name"] == name)
    return phase


def _holds_over_the_limit(report: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(phase["name"], kind, h)
            for phase in report["phases"]
            for kind, h in phase["stats"]["client"]["own_holds"].items()
            if h["over_10ms_cpu"] or h["max_cpu_ms"] > LIMIT_S * 1000.0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bookkeeping_never_holds_the_hub_past_10_ms_with_100_classes(tmp_path: Path) -> None:
    # 100 classes: a whole-card checkpoint re-encoded every cell at once (50-85 ms of CPU on
    # the hub every 2 s); in steps, each slice is a millisecond or so.
    report = _run(tmp_path, _scenario(tmp_path, CLASSES, baseline_s=9))
    baseline = _phase(report, "baseline")
    stats = baseline["stats"]
    holds = stats["client"]["own_holds"]
    print("\nown holds in baseline:", json.dumps(holds))
    assert stats["requests"] >= CLASSES, stats["requests"]   # every class had requests
    # Not vacuous: the checkpoints ran (every 2 s), as did the sample lines and the guard.
    assert holds["checkpoint"]["holds"] >= 3, holds
    assert holds["samples"]["holds"] >= stats["requests"] // 2, holds   # per second, not phase
    assert {"guard", "seconds"} <= holds.keys(), holds
    # The send time is its own figure, on every request written.
    assert stats["send_ms"]["count"] == stats["sent"], stats["send_ms"]
    # The collector's pauses are figures of their own (loadgen/collector.py's policy is
    # opt-in, so a full collection may fall here; it is counted, not hidden).
    assert stats["client"]["gc_pause_max_ms"] is not None, stats["client"]
    assert stats["client"]["gc_full_collections"] is not None, holds
    # No hold of our own past 10 ms of CPU. This kernel charges the interrupts and softirqs
    # served on a CPU to the thread running there (no CONFIG_IRQ_TIME_ACCOUNTING), so on a
    # busy machine one hold can take a burst of network work (seen once in CI: 10.18 ms among
    # 290 sample lines whose longest was otherwise under 1 ms). A second run tells them apart:
    # our own work that is too long is too long again, an interrupt burst does not come back.
    over = _holds_over_the_limit(report)
    if over:
        print("\nholds over the limit in the first run:", json.dumps(over))
        again = tmp_path / "again"
        again.mkdir()
        over_again = _holds_over_the_limit(_run(again, _scenario(again, CLASSES, baseline_s=9)))
        print("holds over the limit in the second run:", json.dumps(over_again))
        assert not over_again, (over, over_again)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_periodic_hub_freeze_marks_the_phase_saturated(tmp_path: Path) -> None:
    # A test-only freeze: the load process holds its hub 100 ms every 2 s, as a heavy
    # synchronous checkpoint would. No p90 of hub lag moves (5% of the time), yet every event
    # that comes during a freeze is dated late.
    report = _run(tmp_path, _scenario(tmp_path, 2, baseline_s=9), env={FREEZE_ENV: "100/2"})
    baseline = _phase(report, "baseline")
    client = baseline["stats"]["client"]
    print("\nclient figures in baseline:", json.dumps(client))
    freeze = client["own_holds"]["test_freeze"]
    assert freeze["holds"] >= 3 and freeze["max_ms"] >= 100.0, freeze    # a wall-clock spin
    assert client["hub_lag_max_ms"] >= 50.0, client
    assert client["saturated"] is True, client
    assert baseline["stats"]["client_saturated"] is True
    assert any("baseline" in e and "saturated" in e for e in report["errors"]), report["errors"]
