"""Faults of two owners on one thing (one GPU setting, one interface and direction, one SSE
proxy): the second is refused with a sentence naming the first, the first's revert restores
exactly the original, whichever ends first, and a SIGKILLed holder's claim is freed only by what
restores the original (`streamquake recover`, or a killed agent's next start).

Owners are real processes: tests/fault_holder.py applies faults through the runner's own Ledger
(a run without load) and holds them until told; agent leases go through `streamquake inject`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nvml_shim import GUARD, FakeGpus

from streamquake.faults.proxy.server import ProxyProcess, start_proxy
from streamquake.faults.tc.netns import NamespaceTopology
from tests.conftest import REPO, cli_cmd, run_cli
from tests.test_agent import local_agent_stopped
from tests.test_tc_host import needs_root, ours_left, tc
from tests.timing import HANG_S, wait_until

__all__ = ["local_agent_stopped"]  # a fixture, used by name

UUID0 = "GPU-fa4e0000-5eed-4c1a-9e57-000000000000"
HOLDER = "import sys; from tests.fault_holder import main; sys.exit(main(sys.argv[1:]))"
EXIT_NOT_APPLIED = 3   # README: "a fault that could not be applied"


class Holder:
    """One owner: a tests/fault_holder.py process holding ``specs`` until ``release``."""

    def __init__(self, specs: list[dict[str, Any]], ctx: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> None:
        # A holder that may change GPU settings first checks that it talks to the emulation.
        guard = GUARD if any(s["type"] == "gpu_clocks" for s in specs) else ""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", guard + HOLDER, json.dumps(specs), json.dumps(ctx or {})],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def said(self) -> str:
        """The holder's next line (hang-only deadline)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], HANG_S)
        assert ready, f"holder {self.pid} said nothing within {HANG_S:g} s"
        return self.proc.stdout.readline().strip()

    def applied(self) -> Holder:
        line = self.said()
        assert line == "APPLIED", line + self._stderr()
        return self

    def refused(self) -> str:
        """The refusal sentence, once the refused holder has ended with the README's code."""
        line = self.said()
        assert line.startswith("REFUSED "), line + self._stderr()
        assert self.said().startswith("REVERTED")
        assert self.proc.wait(timeout=HANG_S) == EXIT_NOT_APPLIED
        self.close()
        return line.removeprefix("REFUSED ")

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.said() == "REVERTED []"
        assert self.proc.wait(timeout=HANG_S) == 0
        self.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=HANG_S)
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def _stderr(self) -> str:
        assert self.proc.stderr is not None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=HANG_S)
        return "\n" + self.proc.stderr.read()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Every holder a test starts; those still running at its end are killed."""
    made: list[Holder] = []
    yield made
    for h in made:
        h.close()


def claims(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "claims.json"
    found: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    return found


def journal(state_dir: Path) -> list[dict[str, Any]]:
    """The journal's fault entries (a tc test's own namespace is journalled too)."""
    path = state_dir / "journal.json"
    found: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    return [e for e in found if e["type"] != "netns"]


def recover(env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cli_cmd("recover"), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=HANG_S * 2)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# -- gpu: the power limit from two runs, SM clock locks from two agent leases ---------------------


@pytest.fixture
def gpus(tmp_path: Path) -> FakeGpus:
    # GPU 0 runs a non-default power limit, so "restored" means "exactly".
    return FakeGpus(tmp_path / "gpus.txt", gpu_count=1, **{"gpu0.power_mw": 600000})


def _power(watts: int, name: str) -> list[dict[str, Any]]:
    return [{"type": "gpu_clocks", "name": name, "gpus": [0], "power_limit_w": watts}]


@pytest.mark.timeout(120)
def test_gpu_power_limits_of_two_runs(gpus: FakeGpus, state_dir: Path,
                                      holders: list[Holder]) -> None:
    env, before = gpus.env(), gpus.text()
    first = Holder(_power(300, "first"), env=env)
    holders.append(first)
    first.applied()
    assert gpus.read()["gpu0.power_mw"] == "300000"
    said = Holder(_power(400, "second"), env=env).refused()
    assert said.startswith(f"the power limit of GPU 0 ({UUID0}) is held by fault 'first' "
                           f"(gpu_clocks) of the run pid {first.pid} since "), said
    assert ", so fault 'second' was not applied" in said, said
    assert said.endswith("wait for that run's phase to end, or stop it (its revert restores "
                         "what was there before)"), said
    # The refused one ended first: its revert touched nothing of the first's.
    assert gpus.read()["gpu0.power_mw"] == "300000"
    assert [c["thing"] for c in claims(state_dir)] == [f"gpu:{UUID0}:power_limit"]
    first.release()
    assert gpus.text() == before               # 600 W, the original, exactly
    assert claims(state_dir) == [] and journal(state_dir) == []
    # The other order: the second holds now, the first is refused, the second's revert restores.
    second = Holder(_power(400, "second"), env=env)
    holders.append(second)
    second.applied()
    assert gpus.read()["gpu0.power_mw"] == "400000"
    assert "held by fault 'second'" in Holder(_power(300, "first"), env=env).refused()
    second.release()
    assert gpus.text() == before
    assert claims(state_dir) == [] and journal(state_dir) == []


@pytest.mark.timeout(120)
def test_one_run_may_not_set_one_gpu_setting_twice(gpus: FakeGpus, state_dir: Path) -> None:
    # Two values for one setting at once have no meaning; the second is refused, the first
    # reverted with it as the run's phase ends.
    before = gpus.text()
    both = Holder([*_power(300, "first"), *_power(400, "second")], env=gpus.env())
    said = both.refused()
    assert "the power limit of GPU 0" in said and "held by fault 'first'" in said, said
    assert gpus.text() == before
    assert claims(state_dir) == [] and journal(state_dir) == []


RUN = """
name: second-power-cap
target: {protocol: anthropic, embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}},
         timeout: 10s}
load: {users: 1, think_time: {min: 50ms, max: 100ms}}
phases: {baseline: 1s, fault: 1s, recovery: 1s}
faults:
  - {type: gpu_clocks, name: second, phase: fault, gpus: [0], power_limit_w: 400}
"""


@pytest.mark.timeout(180)
def test_a_run_whose_fault_is_refused_exits_3_and_says_why(
        gpus: FakeGpus, tmp_path: Path, holders: list[Holder]) -> None:
    env, before = gpus.env(), gpus.text()
    first = Holder(_power(300, "first"), env=env)
    holders.append(first)
    first.applied()
    scenario = tmp_path / "second.yaml"
    scenario.write_text(RUN)
    run = subprocess.run(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out"),
                                 "--no-watchdog"),
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S * 2)
    said = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == EXIT_NOT_APPLIED, said
    assert (f"the power limit of GPU 0 ({UUID0}) is held by fault 'first' (gpu_clocks) of the "
            f"run pid {first.pid} since ") in said, said
    assert gpus.read()["gpu0.power_mw"] == "300000"
    first.release()
    assert gpus.text() == before


def _inject_sm(lock: str, name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_cli("inject", "gpu_clocks", "gpus=[0]", f"sm_clocks_mhz=[{lock}]", "--for", "5m",
                   "--name", name, env=env)


def _sm_lock(name: str) -> list[dict[str, Any]]:
    return [{"type": "gpu_clocks", "name": name, "gpus": [0], "sm_clocks_mhz": [700, 700]}]


@pytest.mark.timeout(240)
def test_gpu_clock_locks_of_two_agent_leases_and_a_killed_agent(
        gpus: FakeGpus, state_dir: Path, holders: list[Holder],
        local_agent_stopped: None) -> None:
    env, before = gpus.env(), gpus.text()
    assert _inject_sm("500,800", "a", env).returncode == 0
    second = _inject_sm("600,900", "b", env)
    assert second.returncode == EXIT_NOT_APPLIED, second.stdout + second.stderr
    said = " ".join(second.stderr.split())
    assert f"the SM clock lock of GPU 0 ({UUID0}) is held by fault 'a' (gpu_clocks) of lease " in (
        said), said
    assert "revert it first (`streamquake revert a`), or wait for its lease to end" in said, said
    assert gpus.read()["gpu0.sm_lock"] == "500,800"      # b's refusal left a's lock alone
    status = run_cli("status", "--json", env=env)
    assert [f["name"] for f in json.loads(status.stdout)["faults"]] == ["a"], status.stdout
    assert run_cli("revert", "a", env=env).returncode == 0
    assert gpus.text() == before                         # unlocked: the original
    assert _inject_sm("600,900", "b", env).returncode == 0
    assert "held by fault 'b'" in " ".join(_inject_sm("500,800", "a", env).stderr.split())
    assert run_cli("revert", "b", env=env).returncode == 0
    assert gpus.text() == before
    assert claims(state_dir) == []
    # A SIGKILLed agent: its lock and claim stay; nobody else takes them until its next start
    # has restored the original.
    assert _inject_sm("500,800", "a", env).returncode == 0
    agent = json.loads((state_dir / "local-agent" / "local.json").read_text())["pid"]
    os.kill(agent, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{agent}").exists(), "the killed agent to be gone")
    run = Holder(_sm_lock("run"), env=env).refused()
    assert "is held by fault 'a' (gpu_clocks) of lease " in run, run
    assert f"of the agent pid {agent} since " in run, run
    assert "that agent is gone: start it again (its start restores what it held" in run, run
    assert gpus.read()["gpu0.sm_lock"] == "500,800"
    assert run_cli("status", env=env).returncode == 0    # starts the agent; it recovers first
    assert gpus.text() == before
    assert claims(state_dir) == []
    run_now = Holder(_sm_lock("run"), env=env)
    holders.append(run_now)
    run_now.applied()
    assert gpus.read()["gpu0.sm_lock"] == "700,700"
    run_now.release()
    assert gpus.text() == before


@pytest.mark.timeout(120)
def test_a_killed_runs_gpu_claim_is_freed_by_recover(gpus: FakeGpus, state_dir: Path,
                                                    holders: list[Holder]) -> None:
    env, before = gpus.env(), gpus.text()
    first = Holder(_power(300, "first"), env=env)
    first.applied()
    first.kill()
    said = Holder(_power(400, "second"), env=env).refused()
    assert f"held by fault 'first' (gpu_clocks) of the run pid {first.pid} since " in said, said
    assert said.endswith("that run is gone: run `streamquake recover` (it restores what the "
                         "run changed), then try again"), said
    assert gpus.read()["gpu0.power_mw"] == "300000"      # never overwritten unrestored
    assert "power limit back to 600 W" in recover(env)
    assert gpus.text() == before
    assert claims(state_dir) == [] and journal(state_dir) == []
    second = Holder(_power(400, "second"), env=env)
    holders.append(second)
    second.applied()
    second.release()
    assert gpus.text() == before


# -- tc: two tbf faults on one interface and direction --------------------------------------------


def _tbf(rate: str, name: str) -> dict[str, Any]:
    return {"type": "tbf", "name": name, "rate": rate}


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_tc_faults_of_two_runs_on_one_interface(topo: NamespaceTopology, client_ns: str,
                                                state_dir: Path, holders: list[Holder]) -> None:
    ctx = {"target_host": topo.target_addr, "target_port": 80, "client_netns": client_ns,
           "network": {"mode": "host"}}
    dev = topo.host_ifname
    first = Holder([_tbf("5mbit", "five")], ctx)
    holders.append(first)
    first.applied()
    shaped = tc(client_ns, "qdisc", "show", "dev", dev)
    assert "rate 5Mbit" in shaped
    said = Holder([_tbf("1mbit", "one")], ctx).refused()
    assert (f"the egress qdisc tree of {dev} in network namespace {client_ns} is held by fault "
            f"'five' (tbf) of the run pid {first.pid} since ") in said, said
    assert tc(client_ns, "qdisc", "show", "dev", dev) == shaped
    first.release()
    assert ours_left(client_ns, dev) == []
    assert claims(state_dir) == [] and journal(state_dir) == []
    second = Holder([_tbf("1mbit", "one")], ctx)
    holders.append(second)
    second.applied()
    assert "held by fault 'one'" in Holder([_tbf("5mbit", "five")], ctx).refused()
    second.release()
    assert ours_left(client_ns, dev) == []
    # One owner's faults on one path still stack (a whole-run profile and a phase fault): the
    # newest matches first, and each revert removes only its own.
    both = Holder([_tbf("5mbit", "five"), _tbf("1mbit", "one")], ctx)
    holders.append(both)
    both.applied()
    stacked = tc(client_ns, "qdisc", "show", "dev", dev)
    assert "rate 5Mbit" in stacked and "rate 1Mbit" in stacked, stacked
    both.release()
    assert ours_left(client_ns, dev) == []
    # A SIGKILLed holder: refused until `recover` has removed what it left.
    first = Holder([_tbf("5mbit", "five")], ctx)
    first.applied()
    first.kill()
    said = Holder([_tbf("1mbit", "one")], ctx).refused()
    assert f"of the run pid {first.pid} since " in said, said
    assert "that run is gone: run `streamquake recover`" in said, said
    assert tc(client_ns, "qdisc", "show", "dev", dev) == shaped
    assert "tbf fault: removed" in recover()
    assert ours_left(client_ns, dev) == []
    assert claims(state_dir) == [] and journal(state_dir) == []
    second = Holder([_tbf("1mbit", "one")], ctx)
    holders.append(second)
    second.applied()
    second.release()
    assert ours_left(client_ns, dev) == []


# -- proxy: two runs' faults in one SSE proxy -----------------------------------------------------


@pytest.fixture
def proxy() -> Iterator[ProxyProcess]:
    # Only its control API is used here: the upstream is never asked.
    with start_proxy("http://127.0.0.1:9") as p:
        yield p


def _in_proxy(p: ProxyProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"{p.control_url}/faults", timeout=HANG_S) as resp:
        faults: dict[str, Any] = json.loads(resp.read())["faults"]
        return faults


SLOW = {"delay_ms": 5.0, "delay_probability": 1.0}


def _sse(name: str, **params: object) -> dict[str, Any]:
    return {"type": "sse_proxy", "name": name, **params}


@pytest.mark.timeout(120)
def test_proxy_faults_of_two_runs_in_one_proxy(proxy: ProxyProcess, state_dir: Path,
                                               holders: list[Holder]) -> None:
    ctx = {"proxy": proxy.control_url}
    addr = proxy.url.removeprefix("http://")
    first = Holder([_sse("slow", delay="5ms")], ctx)
    holders.append(first)
    first.applied()
    # The same name would replace the first's fault (and the first's revert remove this one);
    # another name would change the first run's phase: both are refused.
    for second in (_sse("slow", drop="50%"), _sse("lossy", drop="50%")):
        said = Holder([second], ctx).refused()
        assert (f"the SSE proxy at {addr} is held by fault 'slow' (sse_proxy) of the run pid "
                f"{first.pid} since ") in said, said
    assert _in_proxy(proxy) == {"slow": SLOW}
    first.release()
    assert _in_proxy(proxy) == {}
    assert claims(state_dir) == [] and journal(state_dir) == []
    # One run's faults share its proxy: their effects add up, each revert removes its own.
    both = Holder([_sse("slow", delay="5ms"), _sse("lossy", drop="50%")], ctx)
    holders.append(both)
    both.applied()
    assert sorted(_in_proxy(proxy)) == ["lossy", "slow"]
    assert "held by fault" in Holder([_sse("other", delay="1ms")], ctx).refused()
    both.release()
    assert _in_proxy(proxy) == {}
    # A SIGKILLed holder whose proxy lives on: refused until `recover` removed its fault.
    first = Holder([_sse("slow", delay="5ms")], ctx)
    first.applied()
    first.kill()
    said = Holder([_sse("lossy", drop="50%")], ctx).refused()
    assert f"of the run pid {first.pid} since " in said, said
    assert "that run is gone: run `streamquake recover`" in said, said
    assert _in_proxy(proxy) == {"slow": SLOW}
    assert f"removed fault 'slow' from the SSE proxy at {proxy.control_url}" in recover()
    assert _in_proxy(proxy) == {}
    assert claims(state_dir) == [] and journal(state_dir) == []
    second = Holder([_sse("lossy", drop="50%")], ctx)
    holders.append(second)
    second.applied()
    assert _in_proxy(proxy) == {"lossy": {"drop": 0.5}}
    second.release()
    assert _in_proxy(proxy) == {}
