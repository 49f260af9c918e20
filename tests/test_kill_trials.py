"""Kill trials: a run killed at the worst moments leaves nothing behind once `streamquake recover`
has run, its children stop at once (killed, not drained), and `recover` is quick.

Faults: an SSE proxy fault, a tbf fault with the target in its own namespace (host kernel), a GPU
clock lock (emulated driver), a KV-cache flush every 50 ms (the embedded target's prefix cache; its
flushing dies with the run, and `recover` clears its entry), a noisy tenant's streams (threads of
the run: they end with it; tests/test_noisy_tenant.py shows a target of its own left with none).
Kills: SIGKILL of the run, SIGKILL of its process group, SIGTERM twice (no recover needed: the run
reverts), and SIGKILLs that the run delivers to itself at named points (streamquake/killpoints.py)
between journaling a namespace, the run's tc scaffold, a qdisc or a clock lock and making it, and
right after making it. A netem kill inside UML is in tests/uml. The longer profile is
scripts/kill-trials. Then, with the watchdog: a
kill as the namespace is made is undone by the lease alone; and a child that kills the run before
it sets its death signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_cmd, how_ended, reap
from tests.helpers import wait_for_line
from tests.nvml_shim import FakeGpus
from tests.test_network_cli import _none_left, _ours_in_kernel
from tests.timing import descendants, recover_bound_s, timed_recover, wait_until

TARGET = """
target:
  protocol: openai
  embedded: {ttft: 30ms, itl: 5ms, output_tokens: {min: 20, max: 20}}
  timeout: 10s
load: {users: 3, think_time: {min: 20ms, max: 50ms}}
phases: {warmup: 0.5s, baseline: 1s, fault: 60s, recovery: 1s}
"""
SCENARIOS = {
    "proxy": "name: kill-proxy\n" + TARGET + (
        "faults:\n  - {type: sse_proxy, name: drop, phase: fault, drop: 20%, delay: 5ms}\n"),
    "tbf": "name: kill-tbf\n" + TARGET + (
        "network: {mode: namespace, scope: target, direction: both}\n"
        "faults:\n  - {type: tbf, name: thin, phase: fault, rate: 2mbit, burst: 16kb}\n"),
    "gpu": "name: kill-gpu\n" + TARGET + (
        "faults:\n  - {type: gpu_clocks, name: downclock, phase: fault, "
        "sm_clocks_mhz: [500, 800]}\n"),
    "flush": "name: kill-flush\n" + TARGET.replace(
        "{min: 20, max: 20}}", "{min: 20, max: 20}, prefix_cache: {slots: 2}}") + (
        "faults:\n  - {type: cache_flush, name: flush, phase: fault, every: 50ms}\n"),
    # The noisy tenant's streams are threads of the run: a kill ends them with it.
    "noisy": "name: kill-noisy\n" + TARGET + (
        "faults:\n  - {type: noisy_tenant, name: tenant, phase: fault, concurrency: 4}\n"),
}
REPEAT = int(os.environ.get("STREAMQUAKE_KILL_TRIALS_REPEAT", "1"))   # scripts/kill-trials
TIMES_LOG = os.environ.get("STREAMQUAKE_KILL_TRIALS_LOG")   # "took start-up" per recover


@dataclass
class Trial:
    proc: subprocess.Popen[str]
    output: str


def _start(kind: str, tmp_path: Path, env: dict[str, str],
           kill_at: str | None = None, lease: str | None = None) -> subprocess.Popen[str]:
    scenario = tmp_path / f"{kind}.yaml"
    scenario.write_text(SCENARIOS[kind])
    if kill_at:
        env = {**env, "STREAMQUAKE_KILL_AT": kill_at}
    # --no-watchdog unless a lease is asked for: these trials prove the journal and `recover`
    # on their own (what is left when the watchdog itself is gone); tests/test_fault_lifecycle.py
    # proves the lease, and the watchdog-first trial below that it holds before any change.
    watchdog = ("--lease", lease) if lease else ("--no-watchdog",)
    return subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out"),
                                    *watchdog),
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)




def _recover_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_cmd("recover"), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def _recover(env: dict[str, str], kind: str) -> subprocess.CompletedProcess[str]:
    """`streamquake recover`, which must succeed and be quick: against the CLI's start-up
    measured around it, here (the defect was ~20 s blocked on a dying proxy; typical is 1-3
    start-ups); and, for the proxy, it never waited on one: its proxy was gone, so the answer
    was a refused connection."""
    done, took, start_s = timed_recover(lambda: _recover_once(env), env)
    if TIMES_LOG:
        with open(TIMES_LOG, "a") as log:
            log.write(f"{took:.3f} {start_s:.3f}\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert took < recover_bound_s(start_s), (took, start_s, done.stdout)
    if kind == "proxy":
        assert "no longer answers" in done.stdout, done.stdout
        assert "did not answer within" not in done.stdout, done.stdout
    return done


def _journal(state_dir: Path) -> list[dict[str, object]]:
    path = state_dir / "journal.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.fixture
def gpus(tmp_path: Path) -> FakeGpus:
    return FakeGpus(tmp_path / "nvml-state.txt", gpu_count=1)


def _env(kind: str, gpus: FakeGpus, state_dir: Path) -> dict[str, str]:
    if kind == "gpu":
        return gpus.env(STREAMQUAKE_STATE_DIR=str(state_dir))
    return {**os.environ, "STREAMQUAKE_STATE_DIR": str(state_dir)}


def _check_clean(kind: str, gpus: FakeGpus, original_gpus: str, before: set[str],
                 state_dir: Path) -> None:
    assert _journal(state_dir) == []
    claims = state_dir / "claims.json"    # freed with the entries: nothing left to refuse
    assert not claims.exists() or json.loads(claims.read_text()) == []
    assert _none_left(before) == set()     # what another test has up meanwhile may stay a while
    if kind == "gpu":
        assert gpus.text() == original_gpus


# Each fault kind killed each way once in the suite: 13 trials of a live fault and 8 kill points.
# scripts/kill-trials REPEAT runs the long profile: 18 live trials (the proxy's three ways twice,
# a second SIGKILL of tbf and of the GPU lock) times REPEAT, and the kill points times REPEAT.
LIVE_PROFILE = [("proxy", "kill"), ("proxy", "killpg"), ("proxy", "term2"),
                ("proxy", "kill"), ("proxy", "killpg"), ("proxy", "term2"),
                ("tbf", "kill"), ("tbf", "killpg"), ("tbf", "term2"),
                ("gpu", "kill"), ("gpu", "killpg"), ("gpu", "term2"), ("tbf", "kill"),
                ("gpu", "kill"), ("flush", "kill"), ("flush", "killpg"), ("flush", "term2"),
                ("noisy", "kill")]
LIVE = LIVE_PROFILE * REPEAT if REPEAT > 1 else list(dict.fromkeys(LIVE_PROFILE))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "how"), LIVE, ids=[f"{k}-{h}-{i}" for i, (k, h) in
                                                      enumerate(LIVE)])
def test_a_killed_run_leaves_nothing(kind: str, how: str, tmp_path: Path, state_dir: Path,
                                     gpus: FakeGpus, reaper: None) -> None:
    env = _env(kind, gpus, state_dir)
    before, original_gpus = _ours_in_kernel(), gpus.text()
    proc = _start(kind, tmp_path, env)
    wait_for_line(proc, "fault applied")
    children = descendants(proc.pid)
    assert children, "the run has a target and a load generator"
    if how == "kill":
        proc.send_signal(signal.SIGKILL)
    elif how == "killpg":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)       # a second SIGTERM must not cut the revert short
    proc.communicate(timeout=60)
    # Children of a dead run stop at once: no graceful drain while load keeps flowing. Orphaned,
    # they are adopted and reaped here: each must have died of SIGKILL (PDEATHSIG), however long
    # a busy machine takes to get to them (the deadline is for a hang).
    ended: dict[int, int] = {}
    wait_until(lambda: reap(children, ended), f"children {sorted(children)} of the run to end")
    if how == "term2":
        assert proc.returncode == 143
    else:
        assert proc.returncode == -signal.SIGKILL
        assert ended, "a SIGKILLed run's children are orphans, adopted here"
        assert set(how_ended(ended).values()) == {signal.SIGKILL}, how_ended(ended)
        assert _journal(state_dir), "a killed run leaves its journal for recover"
        _recover(env, kind)
    _check_clean(kind, gpus, original_gpus, before, state_dir)


KILL_POINTS = [("tbf", "netns.journalled"), ("tbf", "netns.created"),
               ("tbf", "tc.scaffold.journalled"), ("tbf", "tc.scaffold.built"),
               ("tbf", "tc.journalled"), ("tbf", "tc.installed"),
               ("gpu", "gpu.journalled"), ("gpu", "gpu.set")] * REPEAT


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "point"), KILL_POINTS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(KILL_POINTS)])
def test_a_kill_between_journal_and_change_is_recovered(
        kind: str, point: str, tmp_path: Path, state_dir: Path, gpus: FakeGpus) -> None:
    env = _env(kind, gpus, state_dir)
    before, original_gpus = _ours_in_kernel(), gpus.text()
    proc = _start(kind, tmp_path, env, kill_at=point)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == -signal.SIGKILL, out   # it died at the point, nowhere else
    assert _journal(state_dir), out
    _recover(env, kind)
    _check_clean(kind, gpus, original_gpus, before, state_dir)
    again = _recover_once(env)
    assert again.returncode == 0 and "nothing to recover" in again.stdout


@pytest.mark.timeout(180)
def test_a_double_sigterm_between_journal_and_revert_leaves_nothing(
        tmp_path: Path, state_dir: Path, gpus: FakeGpus) -> None:
    """Two SIGTERMs at the instant a fault's journal entry exists and its revert is not yet on
    the run's stack (a stop at a step edge): the run reverts it, exits 143, and leaves nothing
    for `recover` (it left the entry, and the next run refused to start)."""
    env = {**_env("proxy", gpus, state_dir), "STREAMQUAKE_KILL_WITH": "SIGTERM SIGTERM"}
    before = _ours_in_kernel()
    proc = _start("proxy", tmp_path, env, kill_at="fault.journalled")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "interrupted by SIGTERM" in out, out
    _check_clean("proxy", gpus, gpus.text(), before, state_dir)
    again = _recover_once(env)
    assert again.returncode == 0 and "nothing to recover" in again.stdout, again.stdout


def _agent_log(state_dir: Path) -> str:
    path = state_dir / "local-agent" / "agent.log"
    return path.read_text() if path.exists() else "(no local agent log)"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["netns.journalled", "netns.created"])
def test_the_watchdog_holds_the_lease_before_the_namespace_exists(
        point: str, tmp_path: Path, state_dir: Path, gpus: FakeGpus) -> None:
    """A run SIGKILLed as it creates the target's namespace (journalled, or just made) leaves
    nothing once its lease lapses, with no `recover` typed: the watchdog held the lease before
    the first change (it used to be asked only after the parts had started)."""
    env = _env("tbf", gpus, state_dir)
    before = _ours_in_kernel()
    proc = _start("tbf", tmp_path, env, kill_at=point, lease="2s")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == -signal.SIGKILL, out   # it died at the point, nowhere else
    wait_until(lambda: _journal(state_dir) == [],
               "the watchdog to undo the killed run's namespace")
    assert _none_left(before) == set()
    assert "lapsed" in _agent_log(state_dir), _agent_log(state_dir)


def _in_session(sid: int) -> set[int]:
    """Every process (zombies included) of the session ``sid``, from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            found.add(int(stat.parent.name))
    return found


ORPHAN = """
name: kill-orphan
target: {{protocol: sse, url: "{url}", path: /ok, timeout: 3s}}
load: {{users: 1, think_time: {{min: 50ms, max: 100ms}}}}
phases: {{baseline: 1s, fault: 120s, recovery: 1s}}
"""


@pytest.mark.timeout(180)
def test_a_child_orphaned_before_it_sets_its_death_signal_does_not_survive(
        echo_server: str, tmp_path: Path, reaper: None) -> None:
    """The classic race, made certain: the run's first child (Locust: the target is a URL)
    SIGKILLs the run between its fork and PR_SET_PDEATHSIG (streamquake/killpoints.py), so no
    death signal will ever come. The child must see it is orphaned and go at once; it used to
    live on, sending load for the whole run's length with nobody measuring."""
    scenario = tmp_path / "orphan.yaml"
    scenario.write_text(ORPHAN.format(url=echo_server))
    proc = subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out"),
                                    "--no-watchdog"),
                            cwd=REPO, env={**os.environ, "STREAMQUAKE_KILL_AT": "spawn.forked"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, _ = proc.communicate(timeout=90)
    left = _in_session(proc.pid)      # start_new_session: the session is the run's pid
    ended: dict[int, int] = {}
    try:
        assert proc.returncode == -signal.SIGKILL, out   # killed by its child, at the point
        assert left, "the child that killed the run is adopted here, alive or not"
        wait_until(lambda: reap(left, ended), f"the orphaned children {sorted(left)} to end")
        assert set(how_ended(ended).values()) == {signal.SIGKILL}, how_ended(ended)
    finally:
        for pid in _in_session(proc.pid) - set(ended):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: reap(left, ended), "the leftovers to be reaped")
