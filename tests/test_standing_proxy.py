"""A standing SSE proxy for game days (`streamquake proxy`), its faults held under leases: real
processes on loopback only (`streamquake target serve`, `streamquake proxy`, the local agent or
a `streamquake agent`), and real streaming requests through the proxy to see each fault."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamquake.procs import read_listening_line, spawn, stop
from tests.conftest import cli_cmd, run_cli
from tests.test_agent import TOKEN, Agent, agents, call, local_agent_stopped, start_agent
from tests.test_sse_proxy import chat, fetch
from tests.timing import HANG_S, wait_until

__all__ = ["agents", "local_agent_stopped"]  # fixtures, used by name

TOKENS = 20
EVENTS = list(range(1, TOKENS + 4))   # the role chunk, one per token, the finish, [DONE]
NOT_CONTENT = [1, TOKENS + 2, TOKENS + 3]


@dataclass
class Standing:
    proc: subprocess.Popen[bytes]
    url: str
    err: Path

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    @property
    def control_url(self) -> str:
        return self.url + "/_streamquake"

    def faults(self) -> dict[str, object]:
        with urllib.request.urlopen(f"{self.control_url}/faults", timeout=HANG_S) as resp:
            found: dict[str, object] = json.loads(resp.read())["faults"]
            return found

    def ids(self) -> list[int]:
        """The event ids of one real streaming request through the proxy."""
        return fetch(self.url, "/v1/chat/completions", chat(TOKENS), timeout_s=HANG_S).ids()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("target") / "target.json"
    config.write_text(json.dumps({"ttft": "20ms", "itl": "0ms", "sse_event_ids": True,
                                  "output_tokens": {"min": TOKENS, "max": TOKENS}}))
    proc = spawn(cli_cmd("target", "serve", "--port", "0", "--config", str(config)),
                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        yield read_listening_line(proc, HANG_S, "the target")
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def start_standing(target: str, tmp_path: Path, *args: str) -> Standing:
    err = tmp_path / "proxy.err"
    with open(err, "wb") as fh:
        proc = spawn(cli_cmd("proxy", "--upstream", target, *args), stdout=subprocess.PIPE,
                     stderr=fh)
    return Standing(proc, read_listening_line(proc, HANG_S, "the standing proxy"), err)


@pytest.fixture
def standing(target: str, tmp_path: Path, state_dir: Path) -> Iterator[Standing]:
    proxy = start_standing(target, tmp_path, "--listen", "127.0.0.1:0")
    yield proxy
    stop(proxy.proc)
    if proxy.proc.stdout is not None:
        proxy.proc.stdout.close()


@pytest.mark.timeout(180)
def test_inject_holds_a_fault_in_a_standing_proxy_until_revert_or_lease_end(
        standing: Standing, state_dir: Path, local_agent_stopped: None) -> None:
    assert standing.ids() == EVENTS

    # No --proxy: the one standing proxy of this host. Every content event dropped.
    held = run_cli("inject", "sse_proxy", "drop=100%", "--for", "10m", "--name", "chunk-drop")
    assert held.returncode == 0, held.stderr
    assert f"through the local agent into the SSE proxy at {standing.address}" in held.stdout
    assert standing.ids() == NOT_CONTENT
    shown = run_cli("status", "--json")
    assert shown.returncode == 0, shown.stderr
    (fault,) = json.loads(shown.stdout)["faults"]
    assert (fault["name"], fault["type"], fault["state"]) == ("chunk-drop", "sse_proxy", "held")
    assert fault["applied"]["proxy_control_url"] == standing.control_url
    # One lease's fault at a time in a proxy (its claim), as for a run's own proxy.
    second = run_cli("inject", "sse_proxy", "delay=5ms", "--for", "10m", "--name", "second")
    assert second.returncode == 3, second.stderr
    assert (f"the SSE proxy at {standing.address} is held by fault 'chunk-drop' (sse_proxy) of "
            "lease ") in second.stderr
    assert list(standing.faults()) == ["chunk-drop"]
    reverted = run_cli("revert", "chunk-drop")
    assert reverted.returncode == 0, reverted.stderr
    assert "reverted chunk-drop (sse_proxy)" in reverted.stdout
    # In words (it was the raw JSON): removed, and the proxy's counters.
    assert "removed: yes" in reverted.stdout and '"events_dropped": 20' in reverted.stdout
    assert standing.faults() == {} and standing.ids() == EVENTS

    # --proxy as printed; nobody reverts it: the lease does, never before its end.
    lapse = run_cli("inject", "sse_proxy", "first_event_delay=50ms", "--for", "2s", "--name",
                    "lapse", "--proxy", standing.address, "--json")
    assert lapse.returncode == 0, lapse.stderr
    lease = json.loads(lapse.stdout)
    assert lease["applied"]["fault"] == {"first_event_delay_ms": 50.0}
    wait_until(lambda: standing.faults() == {}, "the lapsed lease's fault removed")
    gone_at = time.time()
    print(f"\ninject --for 2s into a standing proxy: its fault gone "
          f"{gone_at - lease['applied_at']:.3f} s after it was applied, "
          f"{(gone_at - lease['expires_at']) * 1000:.0f} ms after the lease ended (polled)")
    assert gone_at >= lease["expires_at"] - 0.05, (gone_at, lease["expires_at"])
    assert standing.ids() == EVENTS
    log = (state_dir / "local-agent" / "agent.log").read_text()
    assert "lease of lapse (sse_proxy" in log

    # SIGTERM with a fault inside: removed first, and the proxy no longer offered.
    left = run_cli("inject", "sse_proxy", "drop=100%", "--for", "10m", "--name", "left-in")
    assert left.returncode == 0 and standing.ids() == NOT_CONTENT, left.stderr
    standing.proc.send_signal(signal.SIGTERM)
    assert standing.proc.wait(timeout=HANG_S) == 0
    assert "stopping: fault 'left-in' removed" in standing.err.read_text()
    assert list((state_dir / "proxies").iterdir()) == []
    # The agent sees the proxy gone and ends the hold: `status` no longer lists the fault.
    def listed() -> list[object]:
        shown = run_cli("status", "--json")
        assert shown.returncode == 0, shown.stderr
        faults: list[object] = json.loads(shown.stdout)["faults"]
        return faults
    wait_until(lambda: listed() == [], "the gone proxy's fault no longer held")
    assert ("left-in (sse_proxy, id " in (log := (state_dir / "local-agent" / "agent.log")
                                           .read_text())
            and "ended by itself: the SSE proxy at " in log), log
    gone = run_cli("revert", "left-in")
    assert gone.returncode == 0, gone.stderr
    assert "left-in was already reverted at " in gone.stdout
    assert "(ended by itself): " in gone.stdout
    assert "the proxy process is gone, and the fault ended with it" in gone.stdout

    # No standing proxy left: one sentence, with the command that starts one.
    none = run_cli("inject", "sse_proxy", "drop=100%", "--for", "10m")
    assert none.returncode == 3, none.stderr
    assert none.stderr.count("Error: ") == 1
    assert "no standing SSE proxy runs here" in none.stderr
    assert "start one with `streamquake proxy --upstream URL`" in none.stderr


@pytest.mark.timeout(60)
def test_inject_usage_errors_around_standing_proxies_start_nothing(state_dir: Path) -> None:
    cases = {
        ("sse_proxy", "drop=1", "--at", "http://127.0.0.1:1"):
            "with --at, name the standing SSE proxy the fault goes into: --proxy HOST:PORT",
        ("sse_proxy", "drop=1", "--proxy", "https://127.0.0.1:1"):
            "--proxy: 'https://127.0.0.1:1' does not name a standing SSE proxy",
        ("netem", "delay=1ms", "--target", "127.0.0.1:1", "--proxy", "127.0.0.1:1"):
            "--proxy names a standing SSE proxy, for sse_proxy faults; leave it out for netem",
    }
    for args, said in cases.items():
        done = run_cli("inject", *args, "--for", "1m")
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
    assert not (state_dir / "local-agent").exists()


@pytest.mark.timeout(120)
def test_an_agent_touches_only_the_standing_proxies_it_allows(
        standing: Standing, tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "game-day", "--allow-types", "sse_proxy",
                        "--allow-proxies", standing.address)
    agents.append(agent)
    env = {"STREAMQUAKE_AGENT_TOKEN": TOKEN}
    at = ("--at", agent.url)
    # Outside its list (a loopback port where nothing listens): refused before it is asked.
    refused = run_cli("inject", "sse_proxy", "drop=100%", "--for", "10m", "--proxy",
                      "127.0.0.1:1", *at, env=env)
    assert refused.returncode == 3, refused.stderr
    assert (f"this agent may not touch the SSE proxy at 127.0.0.1:1; it may touch only "
            f"{standing.address} (its --allow-proxies)") in refused.stderr
    status, body = call(agent.url, "POST", "/v1/faults", {
        "fault": {"type": "sse_proxy", "drop": 1}, "lease": 60, "proxy": "ftp://127.0.0.1:1"})
    assert status == 400 and str(body["error"]).startswith(
        "proxy: 'ftp://127.0.0.1:1' does not name a standing SSE proxy"), body
    assert call(agent.url, "GET", "/v1/faults")[1]["faults"] == []
    assert call(agent.url, "GET", "/v1/info")[1]["allow"]["proxies"] == [standing.address]

    held = run_cli("inject", "sse_proxy", "drop=100%", "--for", "10m", "--name", "remote-drop",
                   "--proxy", standing.control_url, *at, env=env)
    assert held.returncode == 0, held.stderr
    assert standing.ids() == NOT_CONTENT
    shown = run_cli("status", *at, "--json", env=env)
    assert [f["name"] for f in json.loads(shown.stdout)["faults"]] == ["remote-drop"]
    reverted = run_cli("revert", "remote-drop", *at, env=env)
    assert reverted.returncode == 0, reverted.stderr
    assert standing.faults() == {} and standing.ids() == EVENTS


@pytest.mark.timeout(60)
def test_a_standing_proxy_refuses_a_wrong_command_line_and_a_taken_port() -> None:
    bad = run_cli("proxy", "--upstream", "ftp://127.0.0.1:1", "--listen", "127.0.0.1:0")
    assert bad.returncode == 2 and "--upstream 'ftp://127.0.0.1:1'" in bad.stderr, bad.stderr
    bad = run_cli("proxy", "--upstream", "http://127.0.0.1:1", "--listen", "nowhere")
    assert bad.returncode == 2 and "--listen 'nowhere': give HOST:PORT" in bad.stderr, bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_cli("proxy", "--upstream", "http://127.0.0.1:1", "--listen",
                       f"127.0.0.1:{port}")
    assert busy.returncode == 3, busy.stderr
    assert busy.stderr.startswith(f"Error: cannot listen on 127.0.0.1:{port}: "), busy.stderr
