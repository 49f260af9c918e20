"""The local agent behind ``streamquake inject``: a per-user daemon, started on first use.

``inject`` without ``--at`` asks this daemon to hold the fault with ``lease = --for``, so the
deadline holds whatever happens to the shell that asked (closed, SIGKILLed): the daemon is
detached by a double fork (``setsid``; its parent exits at once, so it belongs to no terminal and
to no process group a shell could signal) and reverts each fault when its lease lapses. It
listens on 127.0.0.1 on a free port, with a random token in a 0600 file; its state directory
(``$STREAMQUAKE_STATE_DIR/local-agent``, default ``~/.local/state/streamquake/local-agent``, mode
0700) holds the token, ``local.json`` (its URL and pid, while it runs), its journal and its log
(``agent.log``). It exits on its own after ``IDLE_EXIT_S`` with no fault held; when it starts
again it first undoes whatever a killed incarnation left (its journal's orphans).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from streamquake.agentwire.client import AgentClient, AgentUnreachable
from streamquake.errors import InjectorError, StreamquakeError
from streamquake.journal import Journal, journal_path, owner_alive, state_dir
from streamquake.procs import child_env, log_tail, python_module_cmd

LOCAL_TOKEN_ENV = "STREAMQUAKE_LOCAL_AGENT_TOKEN"
IDLE_EXIT_S = 60.0
START_TIMEOUT_S = 20.0


def local_state_dir() -> Path:
    return state_dir() / "local-agent"


@dataclass(frozen=True)
class LocalAgent:
    url: str
    pid: int
    token: str

    def client(self) -> AgentClient:
        return AgentClient(self.url, self.token, label="local")


def _token(sd: Path, create: bool) -> str | None:
    path = sd / "token"
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip() or None
    if not create:
        return None
    sd.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another inject made it a moment ago
        return path.read_text().strip() or None
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token


def find_local_agent(sd: Path | None = None) -> LocalAgent | None:
    """The running local agent, if its discovery file names a live process (no network)."""
    sd = sd or local_state_dir()
    try:
        raw = json.loads((sd / "local.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    pid, start, url = raw.get("pid"), raw.get("pid_start"), raw.get("url")
    if not (isinstance(pid, int) and isinstance(url, str)
            and (start is None or isinstance(start, int))):
        return None
    token = _token(sd, create=False)
    if token is None or not owner_alive(pid, start):
        return None
    return LocalAgent(url, pid, token)


def _answers(agent: LocalAgent) -> bool:
    try:
        agent.client().info()
    except InjectorError:
        return False
    return True


def local_orphans(sd: Path | None = None) -> int:
    """Faults a killed local agent left in its journal (its next start undoes them)."""
    sd = sd or local_state_dir()
    if not (sd / "journal.json").exists():
        return 0
    return len(Journal(sd / "journal.json").orphans())


@contextlib.contextmanager
def _spawn_lock(sd: Path) -> Iterator[None]:
    sd.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(sd / "spawn.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ensure_local_agent(idle_exit_s: float = IDLE_EXIT_S) -> LocalAgent:
    """The running local agent, started (detached) if there is none."""
    sd = local_state_dir()
    found = find_local_agent(sd)
    if found is not None and _answers(found):
        return found
    with _spawn_lock(sd):
        found = find_local_agent(sd)
        if found is not None and _answers(found):
            return found
        token = _token(sd, create=True)
        assert token is not None
        _daemonize(python_module_cmd(
            "streamquake", "agent", "--listen", "127.0.0.1:0", "--state-dir", str(sd),
            "--token-env", LOCAL_TOKEN_ENV, "--discovery-file", str(sd / "local.json"),
            "--exit-when-idle", f"{idle_exit_s:g}s", "--watch-runs", str(journal_path()),
        ), child_env({LOCAL_TOKEN_ENV: token}), sd / "agent.log")
        return _wait_ready(sd)


def _wait_ready(sd: Path) -> LocalAgent:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = find_local_agent(sd)
        if found is not None:
            try:
                found.client().info()
                return found
            except AgentUnreachable:
                pass
        time.sleep(0.05)
    raise StreamquakeError(
        f"the local agent did not start within {START_TIMEOUT_S:g} s; its log "
        f"{sd / 'agent.log'} ends with: {_tail(sd / 'agent.log')}")


def _tail(path: Path, lines: int = 4) -> str:
    try:
        return " | ".join(log_tail(path, lines)) or "(empty)"
    except OSError:
        return "(no log)"


def _daemonize(cmd: list[str], env: dict[str, str], log_path: Path) -> None:
    """Start ``cmd`` detached: double fork and setsid, stdio to ``log_path``, cwd ``/``."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    pid = os.fork()
    if pid == 0:  # the first child: new session, fork again, exit; nothing of ours survives
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.chdir("/")
            os.dup2(null_fd, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            for fd in _open_fds():
                if fd > 2:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            os.execve(cmd[0], cmd, env)
        finally:
            os._exit(127)
    os.close(log_fd)
    os.close(null_fd)
    os.waitpid(pid, 0)


def _open_fds() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))
