"""Real Locust runs through the launcher against the embedded target on 127.0.0.1."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.errors import EXIT_SCENARIO
from streamquake.loadgen.plan import LoadPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.run.launcher import LocustRun, start_locust

STARTUP_S = 5.0     # Locust's import and spawn: 3-4 s on a busy 2-core machine


@pytest.fixture(scope="module")
def fast_target() -> Iterator[TargetProcess]:
    config = TargetConfig.model_validate(
        {"ttft": "50ms", "itl": "5ms", "output_tokens": {"min": 10, "max": 10}})
    with start_target(config) as target:
        yield target


def make_plan(url: str, tmp: Path, seconds: float, startup_s: float = STARTUP_S,
              **kw: Any) -> LoadPlan:
    fields: dict[str, Any] = {
        "base_url": url, "protocol": "openai", "users": 4, "spawn_rate": 100,
        "samples_path": str(tmp / "samples"), "end_at": time.time() + startup_s + seconds,
        "timeout_s": 5.0,
    }
    fields.update(kw)
    return LoadPlan.model_validate(fields)


def run_to_end(plan: LoadPlan, tmp: Path, pad_s: float = 5,
               **kw: Any) -> tuple[LocustRun, list[RequestSample], int]:
    run = start_locust(plan, tmp, run_time_s=plan.end_at - time.time() + pad_s, **kw)
    try:
        rc = run.wait(timeout=plan.end_at - time.time() + plan.timeout_s + 15)
    finally:
        run.stop()
    assert rc == 0, (tmp / "locust.log").read_text()[-3000:]
    return run, run.samples(), rc


def _closed_loop_floor(samples: list[RequestSample], plan: LoadPlan,
                       think_mean_s: float) -> float:
    """Half the requests the users had time for in a closed loop: from the first send to
    end_at, each one alternating a request (as long as they took here, on average) and a
    think time. How slow a busy machine made them does not matter; users that stop looping
    make far fewer."""
    assert samples
    window_s = plan.end_at - min(s.sent for s in samples)
    mean_e2e_s = statistics.mean(s.e2e_ms or 0.0 for s in samples) / 1000
    return 0.5 * plan.users * window_s / (mean_e2e_s + think_mean_s)


@pytest.mark.timeout(120)
def test_closed_loop_run_writes_samples_and_ends_at_end_at(fast_target: TargetProcess,
                                                            tmp_path: Path) -> None:
    plan = make_plan(
        fast_target.url, tmp_path, 5.0,
        arrival={"mode": "closed", "think_time_min_s": 0.05, "think_time_max_s": 0.15},
        classes=[{"name": "chat", "weight": 3}, {"name": "batch", "weight": 1}])
    run, samples, _ = run_to_end(plan, tmp_path, pad_s=60)
    # Locust's --run-time was padded by 60 s; the run ends at end_at instead (stopping takes
    # a busy machine seconds, not half a minute).
    assert time.time() < plan.end_at + 30, time.time() - plan.end_at
    assert len(samples) >= _closed_loop_floor(samples, plan, think_mean_s=0.1), len(samples)
    assert [s.error for s in samples if s.error] == []
    assert {s.cls for s in samples} == {"chat", "batch"}
    assert sum(s.cls == "chat" for s in samples) > sum(s.cls == "batch" for s in samples)
    assert all(s.started <= plan.end_at and s.scheduled is None for s in samples)
    assert all(s.content_events == 10 and s.ttft_ms is not None for s in samples)
    assert [p.name for p in (tmp_path / "samples").iterdir()] == [f"samples-{run.pids[0]}.jsonl"]
    log = (tmp_path / "locust.log").read_text()
    assert "SSE      chat" in log and "TTFT     chat" in log      # Locust's own summary


@pytest.mark.timeout(60)
def test_open_loop_poisson_arrivals_match_the_rate(fast_target: TargetProcess,
                                                   tmp_path: Path) -> None:
    rate, window = 25.0, 4.0
    plan = make_plan(fast_target.url, tmp_path, window + 1.5, users=2, seed=11,
                     arrival={"mode": "open", "rate_per_s": rate, "process": "poisson"})
    _, samples, _ = run_to_end(plan, tmp_path)
    assert [s.error for s in samples if s.error] == []
    # Count arrivals in the last `window` seconds, when every user has long been spawned.
    due = sorted(s.scheduled for s in samples if s.scheduled is not None
                 and plan.end_at - window <= s.scheduled < plan.end_at)
    expected = rate * window
    assert abs(len(due) - expected) <= 3 * expected ** 0.5, len(due)   # 3 sigma of Poisson
    gaps = [b - a for a, b in zip(due, due[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    print(f"\nPoisson {rate:g}/s over {window:g} s: {len(due)} arrivals "
          f"(expected {expected:g}), gap CV {cv:.2f}")
    assert 0.7 <= cv <= 1.3, cv             # exponential gaps; a constant process gives ~0
    delays = [s.queue_delay_ms for s in samples if s.queue_delay_ms is not None]
    assert statistics.median(delays) < 20, statistics.median(delays)
    assert all(s.started < plan.end_at for s in samples)


@pytest.mark.timeout(60)
def test_max_inflight_queues_client_side_and_in_flight_streams_finish(tmp_path: Path) -> None:
    config = TargetConfig.model_validate(
        {"ttft": "600ms", "itl": "10ms", "output_tokens": {"min": 5, "max": 5}})
    with start_target(config) as target:
        plan = make_plan(target.url, tmp_path, 3.0, users=1,
                         arrival={"mode": "open", "rate_per_s": 10, "process": "constant",
                                  "max_inflight": 2})
        _, samples, _ = run_to_end(plan, tmp_path)
    assert samples and [s.error for s in samples if s.error] == []
    spans = [(s.sent, s.sent + (s.e2e_ms or 0) / 1000) for s in samples]
    overlap = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert overlap <= 2, overlap
    # Arrivals come 10/s, two slots serve ~3/s: the wait for a slot shows as queue delay.
    assert max(s.queue_delay_ms or 0 for s in samples) > 500
    assert all(s.started < plan.end_at for s in samples)
    # Streams in flight at end_at were allowed to finish and were recorded.
    assert any(end > plan.end_at for _, end in spans)


@pytest.mark.timeout(60)
def test_master_and_workers_each_write_their_samples(fast_target: TargetProcess,
                                                     tmp_path: Path) -> None:
    # A master and two workers start three interpreters at once: on a busy 2-core machine
    # that took longer than STARTUP_S, and the load window ended before a worker connected.
    plan = make_plan(fast_target.url, tmp_path, 3.0, startup_s=2 * STARTUP_S,
                     arrival={"mode": "closed", "think_time_min_s": 0.05,
                              "think_time_max_s": 0.1})
    run, samples, _ = run_to_end(plan, tmp_path, workers=2)
    files = sorted((tmp_path / "samples").iterdir())
    assert sorted(f.name for f in files) == sorted(f"samples-{p}.jsonl" for p in run.pids[1:])
    assert all(f.read_text().count("\n") >= 5 for f in files)
    assert len(samples) >= _closed_loop_floor(samples, plan, think_mean_s=0.075), len(samples)
    assert [s.error for s in samples if s.error] == []
    assert "2 workers connected" in (tmp_path / "locust.log").read_text()


@pytest.mark.timeout(60)
def test_missing_header_variable_fails_the_load_process_naming_it(
        fast_target: TargetProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SQ_ABSENT_KEY", raising=False)
    plan = make_plan(fast_target.url, tmp_path, 3.0,
                     headers={"Authorization": "Bearer ${SQ_ABSENT_KEY}"})
    run = start_locust(plan, tmp_path, run_time_s=10)
    try:
        rc = run.wait(timeout=30)
    finally:
        run.stop()
    assert rc == EXIT_SCENARIO
    assert "SQ_ABSENT_KEY is not set" in (tmp_path / "locust.log").read_text()
    assert run.samples() == []


@pytest.mark.timeout(30)
def test_launcher_imports_neither_locust_nor_gevent() -> None:
    code = ("import sys, streamquake.run.launcher; "
            "bad = [m for m in ('locust', 'gevent') if m in sys.modules]; "
            "sys.exit(str(bad) if bad else 0)")
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(90)
def test_a_request_timeout_in_fractions_of_a_second_starts_locust(fast_target: TargetProcess,
                                                                  tmp_path: Path) -> None:
    # Locust's --stop-timeout takes whole seconds: 1.5 s must not end the load process at once.
    plan = make_plan(fast_target.url, tmp_path, 2.0, timeout_s=1.5)
    _, samples, rc = run_to_end(plan, tmp_path)
    assert rc == 0 and samples and all(s.error is None for s in samples)
