"""Loads with stages (steps' own loads): a real Locust, through run/launcher.py, against the
embedded target. An open loop's arrivals per second follow a ramp, a rate of 0 and a spike,
every due arrival sent or counted; a closed loop's concurrency follows its user counts, in one
process and over workers."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.errors import ScenarioError
from streamquake.loadgen.plan import LoadPlan, LoadStage
from streamquake.loadgen.samples import RequestSample
from streamquake.run.launcher import LocustRun, start_locust
from streamquake.run.load_from_scenario import load_plan_for
from streamquake.run.timeline import plan_windows
from streamquake.scenario import parse_scenario
from tests.conftest import run_cli
from tests.helpers import assert_run_ok

USERS = 2
FAST = {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 2, "max": 2}}
LEADS_S = (6.0, 20.0, 60.0)     # how long Locust has to start before the stages


def _run(plan_fields: Callable[[float], dict[str, Any]], target: dict[str, Any],
         tmp_path: Path, workers: int = 0) -> tuple[LoadPlan, LocustRun]:
    """A Locust run of the plan with ``plan_fields(t0)``, whose stages begin at t0, once its
    load has begun before t0. On a machine too busy to start Locust in time, again with a
    longer lead (hang-only: a quick machine runs it once)."""
    with start_target(TargetConfig.model_validate(target)) as tgt:
        for attempt, lead in enumerate(LEADS_S):
            run_dir = tmp_path / f"try{attempt}"
            plan = LoadPlan.model_validate({
                "base_url": tgt.url, "protocol": "openai", "spawn_rate": 100,
                "timeout_s": 10.0, "samples_path": str(run_dir / "samples"),
                **plan_fields(time.time() + lead)})
            run = start_locust(plan, run_dir, run_time_s=plan.end_at - time.time(),
                               workers=workers, stop_timeout_s=5)
            try:
                rc = run.wait(timeout=plan.end_at - time.time() + 60)
            finally:
                run.stop()
            assert rc == 0, (run_dir / "locust.log").read_text()[-3000:]
            first = min([s.sent for s in run.samples()] + [u.scheduled for u in run.unsent()])
            if first < plan.stages[0].start:
                return plan, run
    raise AssertionError(f"Locust never started within {LEADS_S[-1]} s")


def _mass(rate: Callable[[float], float], a: float, b: float, n: int = 2000) -> float:
    """The integral of ``rate`` over [a, b) (midpoint rule: exact for the linear pieces)."""
    h = (b - a) / n
    return sum(rate(a + (i + 0.5) * h) for i in range(n)) * h


@pytest.mark.timeout(300)
@pytest.mark.parametrize("process", ["constant", "poisson"])
def test_open_loop_arrivals_per_second_follow_a_ramp_a_pause_and_a_spike(
        tmp_path: Path, process: str) -> None:
    # From t0 (the load starts before, at the first stage's rate): 8 s ramping from 5/s to
    # 40/s, 2 s at 0/s, 5 s at 5/s with 40/s from 2 s to 3.5 s into it.
    def fields(t0: float) -> dict[str, Any]:
        return {"users": USERS, "end_at": t0 + 15, "stages": [
            LoadStage(start=t0, end=t0 + 8, rate_from=5, rate_to=40),
            LoadStage(start=t0 + 8, end=t0 + 10, rate_from=0, rate_to=0),
            LoadStage(start=t0 + 10, end=t0 + 15, rate_from=5, rate_to=5,
                      spike=(t0 + 12, t0 + 13.5, 40))],
                "arrival": {"mode": "open", "rate_per_s": 5, "process": process,
                            "max_inflight": 200}}

    plan, run = _run(fields, FAST, tmp_path)
    t0 = plan.stages[0].start

    def rate(t: float) -> float:
        if t < t0 + 8:
            return 5 + 35 * max(0.0, t - t0) / 8
        if t < t0 + 10:
            return 0.0
        return 40.0 if t0 + 12 <= t < t0 + 13.5 else 5.0

    sent = [s.scheduled for s in run.samples() if s.scheduled is not None]
    unsent = [u.scheduled for u in run.unsent()]
    due = sorted(sent + unsent)
    assert len(sent) == len(run.samples())      # each sample is an arrival of the schedule
    assert due[-1] < plan.end_at

    # Each user's constant process puts in any interval its share of the interval's mass,
    # give or take one: all users, within USERS. A Poisson count, within 5 sigma.
    def tolerance(mass: float) -> float:
        return USERS if process == "constant" else 5 * math.sqrt(mass) + 1

    seconds = []
    for k in range(15):
        a = t0 + k
        got, mass = sum(a <= d < a + 1 for d in due), _mass(rate, a, a + 1)
        seconds.append((k, got, round(mass, 1)))
        assert abs(got - mass) <= tolerance(mass), str(seconds)
    assert [got for k, got, _ in seconds if 8 <= k < 10] == [0, 0]          # rate 0: nothing
    during = sum(t0 + 12 <= d < t0 + 13.5 for d in due)
    assert abs(during - 60) <= tolerance(60), during
    # Every due arrival of the stages, sent or recorded as never sent, and no other.
    total = _mass(rate, t0, plan.end_at, 30_000)
    assert abs(sum(d >= t0 for d in due) - total) <= tolerance(total), (len(due), total)


def _in_flight(samples: list[RequestSample], t: float) -> int:
    return sum(s.sent <= t < s.sent + (s.e2e_ms or 0.0) / 1000 for s in samples)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_closed_loop_concurrency_follows_the_stages_user_counts(
        tmp_path: Path, workers: int) -> None:
    counts = [2, 6, 2]

    def fields(t0: float) -> dict[str, Any]:
        stages = [LoadStage(start=t0 + 5 * i, end=t0 + 5 * (i + 1), users=n)
                  for i, n in enumerate(counts)]
        return {"users": counts[0], "spawn_rate": max(counts), "end_at": stages[-1].end,
                "stages": stages}

    # ~300 ms streams, one after the other: each user has one in flight nearly all the time.
    slow = {"ttft": "200ms", "itl": "10ms", "output_tokens": {"min": 10, "max": 10}}
    plan, run = _run(fields, slow, tmp_path, workers)
    stages, t0 = plan.stages, plan.stages[0].start
    samples = [s for s in run.samples() if s.e2e_ms is not None]
    assert not [s for s in samples if s.error], [s.error_detail for s in samples if s.error]
    seen = []
    for stage in stages:
        # After an edge: users added at the spawn rate, users taken away finish their stream.
        settled = stage.start + 1.5
        for a in (settled, settled + 1, settled + 2):
            peak = max(_in_flight(samples, a + i / 20) for i in range(20))
            seen.append((stage.users, round(a - t0, 1), peak))
    assert all(peak == users for users, _, peak in seen), seen


@pytest.mark.timeout(120)
def test_a_trace_shorter_than_the_run_is_sent_once(tmp_path: Path) -> None:
    """Its last row sent, the replay waits for the end instead of returning: Locust would run
    the task again and replay every row, due in the past, at once (as it did)."""
    offsets = [0.0, 0.5, 1.0]
    with start_target(TargetConfig.model_validate(FAST)) as tgt:
        start_at = time.time() + LEADS_S[0]     # Locust's start on a busy machine: 3-4 s
        plan = LoadPlan.model_validate({
            "base_url": tgt.url, "protocol": "openai", "users": 2, "spawn_rate": 100,
            "samples_path": str(tmp_path / "samples"), "end_at": start_at + 4.0,
            "arrival": {"mode": "trace", "start_at": start_at,
                        "rows": [(o, 5, 2, None, None) for o in offsets]}})
        run = start_locust(plan, tmp_path, run_time_s=plan.end_at - time.time(),
                           stop_timeout_s=5)
        try:
            rc = run.wait(timeout=plan.end_at - time.time() + 60)
        finally:
            run.stop()
    assert rc == 0, (tmp_path / "locust.log").read_text()[-3000:]
    records = [s.scheduled for s in run.samples()] + [u.scheduled for u in run.unsent()]
    assert len(records) == len(offsets)
    assert sorted(d or 0.0 for d in records) == \
        pytest.approx([start_at + o for o in offsets], abs=1e-6)


SCENARIO = """
name: stages
target: {{protocol: openai, embedded: {{}}}}
load: {{{load}}}
steps:
  - {{name: warm, kind: warmup, duration: 2s}}
  - {{name: base, kind: baseline, duration: 4s{base}}}
  - {{name: ramp, kind: recovery, duration: 8s{ramp}}}
"""


@pytest.mark.parametrize(("load", "base", "ramp", "said"), [
    ("users: 2", "", ", load: {rate: {from: 5, to: 40}}",
     "steps.2 (ramp).load: a 'rate' needs an open loop: give the scenario 'load.arrival'"),
    ("arrival: {rate: 5}", ", load: {users: 6}", "",
     "steps.1 (base).load: the load is an open loop (load.arrival): give the step a 'rate'"),
    ("trace: scenarios/traces/synthetic-mooncake.jsonl", "", ", load: {rate: 9}",
     "steps.2 (ramp).load: a trace replay sends each row at its own time"),
])
def test_a_step_load_the_loop_cannot_follow_is_refused_with_where_and_why(
        load: str, base: str, ramp: str, said: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(SCENARIO.format(load=load, base=base, ramp=ramp), "bad.yaml")
    problems = "\n".join(info.value.problems)
    assert said in problems and "bad.yaml:" in problems, problems


def test_steps_loads_become_the_plans_stages_over_their_windows(tmp_path: Path) -> None:
    def plan(load: str, base: str, ramp: str) -> LoadPlan:
        sc = parse_scenario(SCENARIO.format(load=load, base=base, ramp=ramp))
        windows = plan_windows(sc, 1000.0)
        return load_plan_for(sc, "http://127.0.0.1:1", tmp_path, windows[-1].end, windows)

    opened = plan("users: 2, arrival: {rate: 5/s, process: constant}", "",
                  ", load: {rate: {from: 5, to: 40}, spike: {rate: 80, at: 2s, for: 1s}}")
    assert [(s.start, s.end, s.rate_from, s.rate_to, s.spike) for s in opened.stages] == [
        (1000, 1002, 5, 5, None), (1002, 1006, 5, 5, None), (1006, 1014, 5, 40, (1008, 1009, 80))]
    assert opened.users == 2
    closed = plan("users: 3, spawn_rate: 2", ", load: {users: 8}", "")
    assert [(s.start, s.users) for s in closed.stages] == [(1000, 3), (1002, 8), (1006, 3)]
    assert (closed.users, closed.spawn_rate) == (3, 2)
    at_once = plan("users: 3", ", load: {users: 8}", "")
    assert (at_once.users, at_once.spawn_rate) == (3, 8)     # every step's users within 1 s
    # No step with a load of its own: constant load, exactly as before.
    assert plan("users: 3", "", "").stages == []


RUN = """
name: ramp-run
target:
  protocol: openai
  embedded: {ttft: 5ms, itl: 1ms, output_tokens: {min: 2, max: 2}, seed: 3}
load: {users: 2, arrival: {rate: 5/s, process: constant, max_inflight: 200}, seed: 5}
steps:
  - {name: warm, kind: warmup, duration: 6s}
  - {name: base, kind: baseline, duration: 3s}
  - {name: ramp, kind: recovery, duration: 6s,
     load: {rate: {from: 5, to: 35}, spike: {rate: 60, at: 4s, for: 1s}}}
"""


@pytest.mark.timeout(180)
def test_a_run_sends_each_steps_load(tmp_path: Path, state_dir: Path) -> None:
    """Through the CLI: the runner's windows become the plan's stages, and each step's
    arrivals due (sent or not) are its rate's integral, within one per user."""
    scenario = tmp_path / "ramp.yaml"
    scenario.write_text(RUN)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=150)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    due = {p["name"]: p["stats"]["sent"] + p["stats"]["not_sent"] for p in report["phases"]}
    # base: 3 s at 5/s; ramp: 5 to 35 over 6 s (120), but 1 s of it at 60 instead of ~28.3
    ramp = 120 - (5 + 30 * 4.5 / 6) + 60
    assert abs(due["base"] - 15) <= USERS and abs(due["ramp"] - ramp) <= USERS, due



USERS_RUN = """
name: users-run
target:
  protocol: openai
  embedded: {ttft: 5ms, itl: 1ms, output_tokens: {min: 2, max: 2}, seed: 3}
load: {users: 2, think_time: {min: 100ms, max: 100ms}, seed: 5}
steps:
  - {name: warm, kind: warmup, duration: 1s}
  - {name: base, kind: baseline, duration: 3s}
  - {name: more, kind: recovery, duration: 4s, load: {users: 6}}
"""


@pytest.mark.timeout(180)
def test_users_a_later_step_adds_start_with_it(tmp_path: Path, state_dir: Path) -> None:
    """The users Locust adds at a later step's start send from then on: only the users
    spawned before the first step opens wait for it (each user loops at about 9 requests/s:
    three times the users, about three times the rate)."""
    scenario = tmp_path / "users.yaml"
    scenario.write_text(USERS_RUN)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=150)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    sent = {p["name"]: p["stats"]["sent"] for p in report["phases"]}
    assert sent["more"] / 4 > 2 * sent["base"] / 3, sent
