"""Agents on other "hosts": two agents, each in a network namespace of its own behind a veth
pair, and a controller (`streamquake run` with `at: a1` / `at: a2` faults) in a third, all made
by the test. Killing the controller mid-fault, or cutting its link to one agent, leaves each
agent to revert on its own when the lease lapses; `recover` then settles the controller's
journal with the agents. A wrong token and a type outside the allowlist are refused across the
link too. The faults are the example family's marker files, whose effect is visible from here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamquake.faults.tc.netns import NamespaceTopology
from tests.conftest import REPO, cli_cmd
from tests.helpers import assert_run_ok
from tests.test_agent import FAMILY_ENV, TOKEN, Agent, start_agent, stop_agent, wait_gone

pytestmark = pytest.mark.netns
LEASE_S = 2.0


@dataclass
class Site:
    name: str
    topo: NamespaceTopology
    agent: Agent
    flag: Path

    @property
    def url(self) -> str:
        return f"http://{self.topo.target_addr}:7355"


@pytest.fixture
def sites(client_ns: str, tmp_path: Path) -> Iterator[list[Site]]:
    """Agents a1 and a2, each in its own namespace, reachable from ``client_ns`` only."""
    topos: list[NamespaceTopology] = []
    made: list[Site] = []
    try:
        for name in ("a1", "a2"):
            topos.append(NamespaceTopology(host_netns=client_ns).create())
            topo = topos[-1]
            # Plain HTTP with a token beyond loopback: only ever on the test's own veths.
            agent = start_agent(tmp_path, name, "--allow-types", "marker_file",
                                "--insecure-http", netns=topo.netns,
                                listen=f"{topo.target_addr}:7355")
            made.append(Site(name, topo, agent, tmp_path / f"flag-{name}"))
        yield made
    finally:
        for site in made:
            stop_agent(site.agent)
        for topo in topos:
            topo.destroy()


def _controller_env(state_dir: Path) -> dict[str, str]:
    return {**os.environ, **FAMILY_ENV, "STREAMQUAKE_AGENT_TOKEN": TOKEN,
            "STREAMQUAKE_STATE_DIR": str(state_dir)}


def _in(ns: str, *args: str, env: dict[str, str], timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *cli_cmd(*args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _scenario(tmp_path: Path, sites: list[Site], fault_s: float) -> Path:
    agents = "\n".join(f'  - {{name: {s.name}, url: "{s.url}", lease: {LEASE_S:g}s}}'
                       for s in sites)
    faults = "\n".join(f"  - {{type: marker_file, name: f-{s.name}, at: {s.name}, "
                       f"path: {s.flag}}}" for s in sites)
    path = tmp_path / "game-day.yaml"
    path.write_text(f"""\
name: game-day
target:
  protocol: openai
  embedded: {{ttft: 30ms, itl: 5ms, output_tokens: {{min: 5, max: 5}}}}
load: {{users: 2, think_time: {{min: 50ms, max: 100ms}}}}
phases: {{warmup: 1s, baseline: 2s, fault: {fault_s:g}s, recovery: 2s}}
agents:
{agents}
faults:
{faults}
slos:
  - {{metric: error_rate, max: 1%}}
""")
    return path


def _start_run(ns: str, scenario: Path, out: Path, env: dict[str, str]
               ) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cli_cmd("run", str(scenario), "--out",
                                                                   str(out))],
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_applied(proc: subprocess.Popen[str], count: int, timeout_s: float = 60) -> str:
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if sum("fault applied" in s for s in seen) >= count:
            return "".join(seen)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail("the controller never applied its faults:\n" + "".join(seen))


@pytest.mark.timeout(120)
def test_controller_killed_mid_fault_each_agent_reverts_within_its_lease(
        tmp_path: Path, client_ns: str, sites: list[Site]) -> None:
    env = _controller_env(tmp_path / "controller-state")
    a1, a2 = sites

    # Across the link: a wrong token (401) and a type outside the allowlist (403) apply nothing.
    wrong = _in(client_ns, "inject", "marker_file", f"path={a1.flag}", "--for", "1m", "--at",
                a1.url, env={**env, "STREAMQUAKE_AGENT_TOKEN": "not-the-token-0123456789"})
    assert wrong.returncode == 3 and "(401): missing or wrong token" in wrong.stderr
    outside = _in(client_ns, "inject", "tbf", "rate=1mbit", "interface=lo", "scope=interface",
                  "--for", "1m", "--at", a2.url, env=env)
    assert outside.returncode == 3
    assert ("this agent does not allow tbf faults; it allows: marker_file" in outside.stderr)
    assert not a1.flag.exists() and not a2.flag.exists()

    proc = _start_run(client_ns, _scenario(tmp_path, sites, 60), tmp_path / "out", env)
    _wait_applied(proc, 2)
    assert a1.flag.exists() and a2.flag.exists()
    time.sleep(1.5 * LEASE_S)                 # held past one lease: the renewals work
    assert a1.flag.exists() and a2.flag.exists()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    killed_at = time.time()
    after = {s.name: wait_gone(s.flag, 60) - killed_at for s in sites}
    print("\ncontroller SIGKILLed, lease 2 s, renewed every 0.67 s: reverted by the agents "
          + ", ".join(f"{n} {dt:.2f} s" for n, dt in after.items()) + " after the kill")
    for site in sites:
        # Not at once (nobody asked), and no later than a lease after the last renewal, late by
        # less than half a lease (a busy machine wakes a watchdog late by far less; a lease not
        # kept is late by more).
        assert LEASE_S / 3 < after[site.name] < LEASE_S * 1.5, after
        assert "without a renewal: reverting it" in site.agent.text()

    # The controller's journal names both remote faults; recover settles them with the agents.
    entries = json.loads((tmp_path / "controller-state" / "journal.json").read_text())
    assert sorted(e["type"] for e in entries) == ["agent_lease", "agent_lease"]
    recovered = _in(client_ns, "recover", env=env)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    for site in sites:
        assert (f"recovered f-{site.name} (agent_lease, applied by pid {proc.pid}): agent "
                f"{site.name} no longer held it: f-{site.name} is no longer held: it was "
                "reverted at") in recovered.stdout
    assert "(lease expiry)" in recovered.stdout


@pytest.mark.timeout(120)
def test_partition_from_one_agent_makes_it_revert_on_lease_expiry(
        tmp_path: Path, client_ns: str, sites: list[Site]) -> None:
    env = _controller_env(tmp_path / "controller-state")
    a1, a2 = sites
    out = tmp_path / "out"
    proc = _start_run(client_ns, _scenario(tmp_path, sites, 8), out, env)
    _wait_applied(proc, 2)
    time.sleep(LEASE_S / 2)
    subprocess.run(["ip", "-n", client_ns, "link", "set", "dev", a1.topo.host_ifname, "down"],
                   check=True, timeout=10)
    cut_at = time.time()
    gone_s = wait_gone(a1.flag, 60) - cut_at
    print(f"\nlink to a1 cut: a1 reverted {gone_s:.2f} s later (lease 2 s); a2, still "
          "reachable, kept its fault")
    assert LEASE_S / 3 < gone_s < LEASE_S * 1.5, gone_s      # as above
    assert a2.flag.exists()                   # renewed across its own link all along
    rest, _ = proc.communicate(timeout=60)
    assert_run_ok(proc, said=rest)
    assert not a2.flag.exists()

    report = json.loads((out / "report.json").read_text())
    records = {r["name"]: r for r in report["faults"]}
    cut, kept = records["f-a1"], records["f-a2"]
    assert cut["at"] == "a1" and kept["at"] == "a2"
    assert cut["applied"]["read_back"] == {"path": str(a1.flag), "bytes": 8}
    assert cut["reverted"]["by"] == "lease expiry"
    assert "agent a1 (" in cut["reverted"]["agent_unreachable"]
    assert cut["reverted"]["renew_errors"], cut["reverted"]
    assert kept["reverted"]["by"] == "request" and kept["reverted"]["renewals"] >= 3
    assert kept["reverted"]["reverted"] == {"removed": True}
    agents = report["telemetry"]["agents"]
    assert agents["a1"]["faults"] == ["f-a1"] and agents["a2"]["url"] == a2.url
    assert "lapsed" in a1.agent.text() and "[request]" in a2.agent.text()
