"""The fault agent on loopback, through real processes and sockets: `inject --for` outlives a
SIGKILLed shell; the API refuses a wrong token (401) and what its allowlist does not cover (403)
and applies nothing; leases lapse on time; a SIGKILLed agent undoes its orphans when it starts
again; TLS and mTLS; a scenario's preflight reports every agent problem at once.

The helpers here (``start_agent``, ``call``, ``wait_gone``) serve tests/test_agent_netns.py too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_cmd, run_cli

FAMILY_ENV = {"STREAMQUAKE_FAULT_FAMILIES": "tests.example_family"}
TOKEN = "sq-test-token-0123456789abcdef"
OWNER = "sq-test-owner-key-0123456789"      # the key faults are applied with


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start_agent(tmp_path: Path, name: str, *args: str, token: str | None = TOKEN,
                netns: str | None = None, listen: str = "127.0.0.1:0",
                state: Path | None = None) -> Agent:
    """`streamquake agent` as a process (in ``netns`` if given); its log goes to a file, so
    nothing it writes can block on a full pipe."""
    log = tmp_path / f"{name}.log"
    env = {**os.environ, **FAMILY_ENV}
    env.pop("STREAMQUAKE_AGENT_TOKEN", None)
    if token is not None:
        env["STREAMQUAKE_AGENT_TOKEN"] = token
    cmd = cli_cmd("agent", "--listen", listen, "--state-dir",
                  str(state or tmp_path / f"{name}-state"), *args)
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("LISTENING "):
                return Agent(proc, line.split(" ", 1)[1].strip(), log)
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"agent {name} did not start:\n{log.read_text(errors='replace')}")


def stop_agent(agent: Agent) -> None:
    if agent.proc.poll() is None:
        agent.proc.terminate()
        try:
            agent.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait(timeout=5)


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents a test starts (append them); stopped at the end, whatever happened."""
    started: list[Agent] = []
    yield started
    for agent in started:
        stop_agent(agent)


def call(url: str, method: str, path: str, body: object | None = None,
         token: str | None = TOKEN, owner: str | None = OWNER,
         raw: bytes | None = None) -> tuple[int, dict[str, object]]:
    """One API call; ``owner``: the owner key sent (None: none), ``raw``: the body as is."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if owner is not None:
        req.add_header("Streamquake-Owner-Key", owner)
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            status, text = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {"not json": text.decode(errors="replace")}


def wait_gone(path: Path, timeout_s: float) -> float:
    """Wait for ``path`` to disappear; return when it did (time.time()), or fail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not path.exists():
            return time.time()
        time.sleep(0.01)
    pytest.fail(f"{path} still exists after {timeout_s} s")


def wait_logged(log: Path, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        time.sleep(0.02)
    pytest.fail(f"{text!r} never appeared in {log}:\n{log.read_text(errors='replace')}")


@pytest.fixture
def local_agent_stopped(state_dir: Path) -> Iterator[None]:
    """Stop the local daemon `inject` starts (it would otherwise idle for a minute)."""
    yield
    try:
        pid = json.loads((state_dir / "local-agent" / "local.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def _marker(path: Path, name: str = "flag", lease: object = "30s",
            **extra: object) -> dict[str, object]:
    return {"fault": {"type": "marker_file", "name": name, "path": str(path)},
            "lease": lease, "owner": "test", **extra}


# -- what travels: a spec as a scenario writes it -------------------------------------------------


@pytest.mark.timeout(30)
def test_a_spec_travels_to_an_agent_and_validates_back_the_same() -> None:
    from streamquake.faults import catalog
    from streamquake.faults.written import as_written
    from streamquake.scenario import load_scenario

    specs = [f for name in ("quickstart", "cross-region-jitter", "gpu-downclock",
                            "openai-classes") for f in load_scenario(
                                REPO / f"scenarios/{name}.yaml").faults]
    written = [
        {"type": "netem", "profile": "cross-region", "loss": "1%", "rate": "8mbit"},
        {"type": "tbf", "rate": "8mbit", "burst": "32kb", "latency": "1m30s", "at": "a1"},
        {"type": "sse_proxy", "stall": {"probability": "1%", "duration": "600ms"},
         "truncate_after_bytes": "2kb", "abort": {"status": 503, "probability": "5%"}},
        {"type": "gpu_clocks", "gpus": [0, "GPU-1"], "sm_clocks": ["30%", "50%"]},
    ]
    types = catalog.fault_types()
    specs += [types[str(w["type"])].spec.model_validate(w) for w in written]
    for spec in specs:
        # A plain dump holds a rate in bytes/s, which the rate validator refuses without unit.
        assert type(spec).model_validate(as_written(spec)) == spec, spec


# -- inject from a shell that is SIGKILLed ------------------------------------------------------


@pytest.mark.timeout(60)
def test_inject_deadline_holds_after_its_shell_is_sigkilled(
        tmp_path: Path, state_dir: Path, local_agent_stopped: None) -> None:
    flag = tmp_path / "flag"
    inject = " ".join(cli_cmd("inject", "marker_file", f"path={flag}", "--for", "4s", "--json"))
    shell = subprocess.Popen(["bash", "-c", f"{inject}; echo INJECTED; sleep 60"], cwd=REPO,
                             env={**os.environ, **FAMILY_ENV}, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert shell.stdout is not None
    out = []
    for line in shell.stdout:
        if line.startswith("INJECTED"):
            break
        out.append(line)
    held = json.loads("".join(out))
    assert flag.read_text() == "fault on"
    os.killpg(shell.pid, signal.SIGKILL)            # the shell and its sleep, at once
    shell.wait(timeout=10)
    shell.stdout.close()
    killed_at = time.time()
    assert killed_at < held["expires_at"] - 1, "the kill came too late to prove anything"
    assert flag.exists()                            # the shell's death reverts nothing ...
    gone_at = wait_gone(flag, 10)                   # ... the lease does
    late_s = gone_at - held["expires_at"]
    print(f"\ninject --for 4s: held {gone_at - held['applied_at']:.3f} s; reverted "
          f"{late_s * 1000:.0f} ms after the lease ended ({gone_at - killed_at:.2f} s after "
          "the shell was SIGKILLed)")
    # Never early; late only by how long a busy machine takes to wake the watchdog, which wakes
    # at the lease's end: half a lease late is a lease not kept (a coarse tick, a lease counted
    # from the wrong time), not scheduling.
    assert -0.05 < late_s < 4 / 2, late_s
    log = state_dir / "local-agent" / "agent.log"
    wait_logged(log, "[lease expiry]")              # written once the journal is updated too
    assert "without a renewal: reverting it" in log.read_text()


# -- the API: auth, allowlist, leases ------------------------------------------------------------


@pytest.mark.timeout(90)
def test_api_refuses_wrong_tokens_and_outside_the_allowlist_and_holds_leases(
        tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "a", "--allow-types", "marker_file,tbf",
                        "--allow-types", "gpu_clocks", "--allow-interfaces", "lo",
                        "--allow-gpus", "0")
    agents.append(agent)
    url, flag = agent.url, tmp_path / "flag"

    # No token, a wrong one: 401, and nothing applied or journalled.
    for token in (None, "wrong-token-0123456789"):
        status, body = call(url, "POST", "/v1/faults", _marker(flag), token=token)
        assert status == 401 and "missing or wrong token" in str(body["error"])
    assert not flag.exists()
    assert json.loads((tmp_path / "a-state" / "journal.json").read_text()) == []
    status, _ = call(url, "GET", "/v1/info", token=None)
    assert status == 401

    # Outside the allowlist: 403 with a sentence that says what is allowed.
    refusals = {
        "netem": ({"type": "netem", "delay": "10ms"},
                  "this agent does not allow netem faults; it allows: gpu_clocks, "
                  "marker_file, tbf"),
        "interface": ({"type": "tbf", "rate": "1mbit", "interface": "eth9"},
                      "this agent may not shape eth9; it may shape only lo"),
        "no interface": ({"type": "tbf", "rate": "1mbit"},
                         "this agent may shape only lo: name the interface (`interface:` on "
                         "the fault, or `network.interface`)"),
        "all gpus": ({"type": "gpu_clocks", "sm_clocks_mhz": [500, 800]},
                     "`gpus: all` would touch every GPU, and this agent may touch only 0: "
                     "list them"),
        "gpu 3": ({"type": "gpu_clocks", "gpus": [3], "sm_clocks_mhz": [500, 800]},
                  "this agent may not touch GPU 3; it may touch only 0 (give GPUs as the "
                  "agent lists them, index or UUID)"),
    }
    for case, (fault, sentence) in refusals.items():
        status, body = call(url, "POST", "/v1/faults", {"fault": fault, "lease": "5s"})
        assert (status, body["error"]) == (403, sentence), case
    # A bad parameter is the spec model's own sentence (400).
    status, body = call(url, "POST", "/v1/faults", _marker(Path("relative/flag")))
    assert status == 400
    assert body["error"] == "fault.path: must be an absolute path, e.g. /tmp/streamquake-flag"

    # Held while renewed; reverted by the watchdog once renewals stop.
    status, held = call(url, "POST", "/v1/faults", _marker(flag, lease=1.5))
    assert status == 201 and flag.exists(), held
    assert held["applied"] == {"path": str(flag), "bytes": 8} and held["state"] == "held"
    status, body = call(url, "POST", "/v1/faults", _marker(tmp_path / "other"))
    assert status == 409 and "a fault named flag is held here already" in str(body["error"])
    for _ in range(4):                              # 2 s of renewals: longer than the lease
        time.sleep(0.5)
        last_renewal = time.time()                  # the agent renews no earlier than this
        status, renewed = call(url, "POST", f"/v1/faults/{held['id']}/renew", {})
        assert status == 200 and flag.exists()
    assert renewed["renewals"] == 4
    gone_at = wait_gone(flag, 30)
    late_s = gone_at - float(str(renewed["expires_at"]))
    print(f"\nlease 1.5 s: reverted {late_s * 1000:.0f} ms after the lease ended "
          f"({gone_at - last_renewal:.3f} s after the last renewal was sent)")
    # A whole lease after the last renewal, never less; late by less than half a lease (see
    # the inject test above).
    assert -0.05 < late_s < 1.5 / 2 and gone_at - last_renewal > 1.5 - 0.05
    wait_logged(agent.log, "[lease expiry]")         # done: its journal entry is gone too
    status, body = call(url, "POST", f"/v1/faults/{held['id']}/renew", {})
    assert status == 410 and "it was reverted at" in str(body["error"])
    assert isinstance(body["ended"], dict) and body["ended"]["by"] == "lease expiry"

    # The CLI against it: a wrong token and an allowlist refusal exit 3; status; revert.
    env = {**FAMILY_ENV, "STREAMQUAKE_AGENT_TOKEN": "wrong-token-0123456789"}
    bad = run_cli("inject", "marker_file", f"path={flag}", "--for", "1m", "--at", url, env=env)
    assert bad.returncode == 3 and "(401): missing or wrong token" in bad.stderr
    env["STREAMQUAKE_AGENT_TOKEN"] = TOKEN
    bad = run_cli("inject", "tbf", "rate=1mbit", "--for", "1m", "--at", url, "--target",
                  "127.0.0.1:9", env=env)
    assert bad.returncode == 3 and "this agent may shape only lo" in bad.stderr
    assert not flag.exists()
    asked = time.monotonic()
    ok = run_cli("inject", "marker_file", f"path={flag}", "--for", "1m30s", "--name", "m1",
                 "--at", url, env=env)
    assert ok.returncode == 0 and flag.exists(), ok.stderr
    assert "injected m1 (marker_file)" in ok.stdout and "held for 1m30s" in ok.stdout
    # What is now in place, in one line for people (the agent's whole record: --json).
    assert ok.stdout.splitlines()[1].startswith("in place ") and "ms after asking: " \
        f"marker_file path={flag}" in ok.stdout and len(ok.stdout.splitlines()) == 2, ok.stdout
    listed = run_cli("status", "--at", url, "--json", env=env)
    since_s = time.monotonic() - asked               # two CLI runs: seconds on a busy machine
    (shown,) = json.loads(listed.stdout)["faults"]
    assert shown["name"] == "m1" and 90 - since_s - 0.05 <= shown["remaining_s"] <= 90, \
        (shown, since_s)
    assert shown["owner"].endswith(")") and "inject" in shown["owner"]
    # For people: the parameters too, as the scenario or inject writes them.
    table = run_cli("status", "--at", url, env={**env, "COLUMNS": "200"})
    assert "settings" in table.stdout and f"path={flag}" in table.stdout, table.stdout
    reverted = run_cli("revert", "m1", "--at", url, env=env)
    assert reverted.returncode == 0 and "reverted m1 (marker_file)" in reverted.stdout
    assert not flag.exists()
    again = run_cli("revert", "m1", "--at", url, env=env)
    assert again.returncode == 0 and "m1 was already reverted" in again.stdout
    missing = run_cli("revert", "nope", "--at", url, env=env)
    assert missing.returncode == 2 and "no fault with the id or name 'nope'" in missing.stderr


@pytest.mark.timeout(30)
def test_agent_will_not_listen_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STREAMQUAKE_AGENT_TOKEN"}
    proc = subprocess.run(cli_cmd("agent", "--listen", "0.0.0.0:0", "--state-dir",
                                  str(tmp_path / "s")), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=20)
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: refusing to listen on 0.0.0.0 without a token")


@pytest.mark.timeout(60)
def test_agent_takes_a_token_over_plain_http_beyond_loopback_only_when_told(
        tmp_path: Path) -> None:
    env = {**os.environ, **FAMILY_ENV, "STREAMQUAKE_AGENT_TOKEN": TOKEN}
    cmd = cli_cmd("agent", "--listen", "0.0.0.0:0", "--state-dir", str(tmp_path / "s"))
    refused = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=20)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith(
        "Error: refusing to take a bearer token over plain HTTP on 0.0.0.0: anyone on the "
        "network path could read it and apply faults; give --tls-cert and --tls-key"), \
        refused.stderr
    # Told so, it starts, and says so loudly on stderr and in its log. Nothing is sent to it:
    # it is stopped once it listens.
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([*cmd, "--insecure-http"], cwd=REPO, env=env, stdout=fo,
                                stderr=fe)
    try:
        wait_logged(out, "LISTENING http://0.0.0.0:")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    warning = ("WARNING: INSECURE: the bearer token from $STREAMQUAKE_AGENT_TOKEN travels in "
               "clear text over plain HTTP on 0.0.0.0 (--insecure-http)")
    assert warning in err.read_text() and warning in out.read_text()


@pytest.mark.timeout(90)
def test_only_a_faults_owner_renews_or_reverts_it_unless_forced(
        tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "own")
    agents.append(agent)
    url, flag = agent.url, tmp_path / "flag"
    other = "someone-elses-owner-key-987654321"
    status, body = call(url, "POST", "/v1/faults", _marker(flag), owner=None)
    assert status == 400 and "send an owner key" in str(body["error"]), body
    status, held = call(url, "POST", "/v1/faults", _marker(flag, lease="1h"))
    assert status == 201 and flag.exists(), held

    # Another key, or none: 403 with a sentence; nothing renewed or reverted.
    for key in (other, None):
        for method, path in (("POST", "/v1/faults/flag/renew"), ("DELETE", "/v1/faults/flag")):
            status, body = call(url, method, path, {} if method == "POST" else None, owner=key)
            assert status == 403, (key, path, body)
            assert str(body["error"]).startswith("flag belongs to another owner (test): only "
                                                 "the owner key it was applied with"), body
            assert "`streamquake revert flag --force`" in str(body["error"])
    status, everything = call(url, "DELETE", "/v1/faults", owner=other)
    assert status == 200 and everything["reverted"] == [], everything
    assert everything["skipped"] == ["flag (owner test)"]
    assert flag.exists()
    status, renewed = call(url, "POST", "/v1/faults/flag/renew", {})
    assert status == 200 and renewed["renewals"] == 1
    # The key is a secret: never listed, never logged.
    assert OWNER not in json.dumps(call(url, "GET", "/v1/faults")[1])
    assert OWNER not in json.dumps(renewed) and OWNER not in agent.text()

    # An operator's emergency revert: forced, and logged loudly.
    status, done = call(url, "DELETE", "/v1/faults/flag?force=true", owner=other)
    assert status == 200 and done["name"] == "flag" and not flag.exists(), done
    assert f"WARNING: FORCED revert of flag (marker_file, id {held['id']}, owner test)" in \
        agent.text()

    # The CLI: each user's key flows on its own; another user needs --force.
    alice = {**FAMILY_ENV, "STREAMQUAKE_AGENT_TOKEN": TOKEN,
             "STREAMQUAKE_STATE_DIR": str(tmp_path / "alice")}
    bob = {**alice, "STREAMQUAKE_STATE_DIR": str(tmp_path / "bob")}
    ok = run_cli("inject", "marker_file", f"path={flag}", "--for", "10m", "--name", "m1",
                 "--at", url, env=alice)
    assert ok.returncode == 0 and flag.exists(), ok.stderr
    for args in (["m1"], ["--all"]):
        refused = run_cli("revert", *args, "--at", url, env=bob)
        assert refused.returncode == 3, (args, refused.stdout, refused.stderr)
        assert "belongs to another owner" in refused.stderr and "m1" in refused.stderr
        assert "--force" in refused.stderr and flag.exists()
    forced = run_cli("revert", "m1", "--force", "--at", url, env=bob)
    assert forced.returncode == 0 and "reverted m1 (marker_file)" in forced.stdout, forced
    assert not flag.exists()
    assert "WARNING: FORCED revert of m1" in agent.text()
    again = run_cli("inject", "marker_file", f"path={flag}", "--for", "10m", "--name", "m2",
                    "--at", url, env=alice)
    assert again.returncode == 0, again.stderr
    mine = run_cli("revert", "--all", "--at", url, env=alice)
    assert mine.returncode == 0 and "reverted m2 (marker_file)" in mine.stdout, mine.stderr
    assert not flag.exists()


@pytest.mark.timeout(60)
def test_a_lease_is_a_number_of_seconds_not_true_or_null(
        tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "lease")
    agents.append(agent)
    url, flag = agent.url, tmp_path / "flag"
    for lease in (True, False, None, "soon", [30], {"s": 30}):
        status, body = call(url, "POST", "/v1/faults", _marker(flag, lease=lease))
        assert status == 400, (lease, body)
        assert body["error"] == ('lease: give seconds as a number (e.g. 30) or a duration '
                                 f'such as "30s", not {json.dumps(lease)}'), body
        assert body["problems"] == [body["error"]]
    assert not flag.exists()
    status, held = call(url, "POST", "/v1/faults", _marker(flag, lease=30))
    assert status == 201 and held["lease_s"] == 30
    for lease in (True, None, "soon"):
        status, body = call(url, "POST", "/v1/faults/flag/renew", {"lease": lease})
        assert status == 400 and str(body["error"]).startswith("lease: give seconds"), body
    for body, lease_s in (({}, 30), ({"lease": "1m"}, 60), ({"lease": 45}, 45)):
        status, renewed = call(url, "POST", "/v1/faults/flag/renew", body)
        assert status == 200 and renewed["lease_s"] == lease_s, renewed
    status, body = call(url, "POST", "/v1/runs", {"pid": 1, "journal": "/j", "lease": True})
    assert status == 400 and str(body["error"]).startswith("lease: give seconds"), body


@pytest.mark.timeout(60)
def test_json_nested_too_deep_is_a_400_not_a_crash(tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "deep")
    agents.append(agent)
    url = agent.url
    deep = b'{"fault": ' + b"[" * 100_000 + b"]" * 100_000 + b', "lease": 30}'
    for method, path in (("POST", "/v1/faults"), ("POST", "/v1/preflight"),
                         ("POST", "/v1/faults/flag/renew")):
        status, body = call(url, method, path, raw=deep)
        assert status == 400, (path, body)
        assert body["error"] == ("the request body nests deeper than 32 levels: send the fault "
                                 "as a scenario writes it"), body
    # Unterminated strings everywhere: a 400 at once, not a scan of the rest from every quote
    # (the call's 15 s timeout is the hang deadline).
    status, body = call(url, "POST", "/v1/faults", raw=b'"\\' * 100_000)
    assert (status, body["error"]) == (400, "the request body is not JSON"), body
    # Brackets inside strings are text, not nesting.
    flag = tmp_path / ("[{" * 40)
    status, held = call(url, "POST", "/v1/faults", _marker(flag))
    assert status == 201 and flag.exists(), held
    assert call(url, "GET", "/v1/info")[0] == 200
    assert "Traceback" not in agent.text() and "RecursionError" not in agent.text()


# -- the agent's own death ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_agent_sigkilled_recovers_its_orphans_when_it_starts_again(
        tmp_path: Path, agents: list[Agent]) -> None:
    state, flag = tmp_path / "agent-state", tmp_path / "flag"
    first = start_agent(tmp_path, "first", state=state)
    agents.append(first)
    status, held = call(first.url, "POST", "/v1/faults", _marker(flag, lease="1h"))
    assert status == 201 and flag.exists()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=10)
    assert flag.exists()                                 # nobody reverted it ...
    (entry,) = json.loads((state / "journal.json").read_text())
    assert entry["pid"] == first.proc.pid and entry["state"] == {"path": str(flag)}

    second = start_agent(tmp_path, "second", state=state)   # ... until the agent is back
    agents.append(second)
    assert not flag.exists()
    said = (f"recovered flag (marker_file, applied by pid {first.proc.pid}): removed {flag}")
    assert f"recovery at start: {said}" in second.text()
    status, info = call(second.url, "GET", "/v1/info")
    assert status == 200 and info["recovered"] == [said] and info["held"] == 0
    assert json.loads((state / "journal.json").read_text()) == []
    # One agent per state directory: a second one would undo the first's faults at start.
    clash = subprocess.run(cli_cmd("agent", "--listen", "127.0.0.1:0", "--state-dir",
                                   str(state)), cwd=REPO, capture_output=True, text=True,
                           timeout=20, env={**os.environ, **FAMILY_ENV})
    assert clash.returncode == 3
    assert f"another agent uses the state directory {state} (pid {second.proc.pid})" in \
        clash.stderr


# -- TLS and mTLS ----------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "1", "-subj", "/CN=sq-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out",
                 f"{who}.csr", "-subj", f"/CN=sq-{who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{who}.pem", "-days", "1",
                 *(["-extfile", "san.cnf"] if who == "server" else []), cwd=d)


@pytest.mark.timeout(90)
def test_tls_and_mutual_tls(tmp_path: Path, agents: list[Agent]) -> None:
    _pki(tmp_path)
    agent = start_agent(tmp_path, "tls", "--tls-cert", str(tmp_path / "server.pem"),
                        "--tls-key", str(tmp_path / "server.key"), "--tls-client-ca",
                        str(tmp_path / "ca.pem"))
    agents.append(agent)
    assert agent.url.startswith("https://127.0.0.1:")
    env = {**FAMILY_ENV, "STREAMQUAKE_AGENT_TOKEN": TOKEN}
    ca = ["--ca-cert", str(tmp_path / "ca.pem")]
    client = ["--client-cert", str(tmp_path / "client.pem"), "--client-key",
              str(tmp_path / "client.key")]
    ok = run_cli("status", "--at", agent.url, *ca, *client, "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["faults"] == []
    no_client_cert = run_cli("status", "--at", agent.url, *ca, env=env)
    assert no_client_cert.returncode == 3
    assert "client certificate" in no_client_cert.stderr, no_client_cert.stderr
    unknown_ca = run_cli("status", "--at", agent.url, *client, env=env)
    assert unknown_ca.returncode == 3
    assert "the TLS handshake failed" in unknown_ca.stderr and "CERTIFICATE_VERIFY_FAILED" in \
        unknown_ca.stderr


# -- a scenario's preflight ----------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_run_preflight_reports_every_agent_problem_at_once(
        tmp_path: Path, agents: list[Agent]) -> None:
    picky = start_agent(tmp_path, "picky", "--allow-types", "tbf")
    agents.append(picky)
    scenario = tmp_path / "remote.yaml"
    scenario.write_text(f"""\
name: remote-preflight
target: {{protocol: openai, embedded: {{ttft: 30ms, itl: 5ms}}}}
phases: {{baseline: 1s, fault: 1s, recovery: 1s}}
agents:
  - {{name: picky, url: "{picky.url}", lease: 3s}}
  - {{name: gone, url: "http://127.0.0.1:{_closed_port()}"}}
faults:
  - {{type: marker_file, name: f1, at: picky, path: {tmp_path / "f1"}}}
  - {{type: marker_file, name: f2, at: gone, path: {tmp_path / "f2"}}}
  - {{type: marker_file, name: f3, at: gone, path: {tmp_path / "f3"}}}
""")
    env = {**FAMILY_ENV, "STREAMQUAKE_AGENT_TOKEN": TOKEN}
    valid = run_cli("validate", str(scenario), env=env)
    assert valid.returncode == 0, valid.stderr
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    host = socket.gethostname()
    assert (f"Error: fault 'f1' (marker_file): agent picky (host {host}) does not allow "
            "marker_file faults; it allows: tbf") in proc.stderr
    # The unreachable agent is reported once, not once per fault.
    assert proc.stderr.count("agent gone (http://127.0.0.1:") == 1
    assert "is unreachable (Connection refused)" in proc.stderr
    assert not any((tmp_path / f).exists() for f in ("f1", "f2", "f3"))

    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(scenario.read_text().replace("at: gone", "at: elsewhere"))
    bad = run_cli("validate", str(unknown), env=env)
    assert bad.returncode == 2
    assert ("fault 'f2' runs at 'elsewhere', but `agents` lists no agent of that name "
            "(listed: picky, gone)") in bad.stderr


# -- stopping: SIGTERM reverts everything; a local agent exits when idle ----------------------


@pytest.mark.timeout(60)
def test_sigterm_reverts_everything_and_an_idle_agent_exits(
        tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "term")
    agents.append(agent)
    flags = [tmp_path / "one", tmp_path / "two"]
    for i, flag in enumerate(flags):
        assert call(agent.url, "POST", "/v1/faults", _marker(flag, name=f"f{i}"))[0] == 201
    agent.proc.terminate()
    assert agent.proc.wait(timeout=20) == 0
    assert not any(f.exists() for f in flags)
    assert "stopping: reverted f0" in agent.text() and "stopping: reverted f1" in agent.text()

    found = tmp_path / "idle-state" / "local.json"
    # Idle 5 s before it leaves: with 1 s, a fresh clone's CI (2026-12-05) read its discovery
    # file after the agent, idle since it said it listened, had left and removed it.
    idle = start_agent(tmp_path, "idle", "--exit-when-idle", "5s", "--discovery-file",
                       str(found), state=tmp_path / "idle-state")
    agents.append(idle)
    assert json.loads(found.read_text())["pid"] == idle.proc.pid
    started = time.monotonic()                    # the lease starts no earlier than this
    assert call(idle.url, "POST", "/v1/faults", _marker(flags[0], lease=1))[0] == 201
    # Lease 1 s, then idle 5 s: it leaves (the wait's deadline is for a hang: an agent that
    # never found itself idle), and not before both are over.
    assert idle.proc.wait(timeout=60) == 0
    took = time.monotonic() - started
    assert took >= 6.0 - 0.05, took
    assert not flags[0].exists() and not found.exists()
    assert "idle for 5 s with no fault held: exiting" in idle.text()


@pytest.mark.timeout(60)
def test_a_killed_local_agent_is_restarted_by_status_and_undoes_its_faults(
        tmp_path: Path, state_dir: Path, local_agent_stopped: None) -> None:
    flag = tmp_path / "flag"
    held = run_cli("inject", "marker_file", f"path={flag}", "--for", "10m", env=FAMILY_ENV)
    assert held.returncode == 0 and flag.exists(), held.stderr
    first = json.loads((state_dir / "local-agent" / "local.json").read_text())["pid"]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{first}").exists():
        time.sleep(0.02)
    assert flag.exists()
    status = run_cli("status", env=FAMILY_ENV)
    assert status.returncode == 0, status.stderr
    assert ("the local agent was killed with faults held; at its restart it recovered "
            f"marker_file (marker_file, applied by pid {first}): removed {flag}") in \
        status.stdout
    assert "nothing held by the agent" in status.stdout
    assert not flag.exists()


@pytest.mark.timeout(30)
def test_the_daemonset_example_runs_this_agent_with_options_it_has() -> None:
    import typer.main
    from ruamel.yaml import YAML

    from streamquake.cli import app

    docs = list(YAML(typ="safe").load_all((REPO / "deploy/k8s/agent-daemonset.yaml").read_text()))
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["command"] == ["streamquake", "agent"]
    token = next(e for e in container["env"] if e["name"] == "STREAMQUAKE_AGENT_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "streamquake-agent-token"
    group = typer.main.get_command(app)
    assert isinstance(group, typer.main.TyperGroup)
    agent = group.commands["agent"]
    # Each fault family adds its own --allow-<what> options, as the command is parsed.
    params = agent.get_params(agent.make_context("agent", [], resilient_parsing=True))
    known = {opt for p in params for opt in getattr(p, "opts", [])}
    given = {arg.split("=", 1)[0] for arg in container["args"]}
    assert given <= known, given - known
    assert "--token-env" in given and "--tls-cert" in given
