"""Shared test helpers: run the real CLI in a subprocess, with its own journal; adopt and reap
the orphans of a run a test stops, to see how each one ended."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamquake.procs import read_listening_line, spawn, stop
from tests.netns_fixtures import client_ns, serve, topo

__all__ = ["client_ns", "serve", "topo"]  # fixtures for the network tests

REPO = Path(__file__).resolve().parent.parent
_PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private fault journal for every test, so no test sees (or leaves) a real one."""
    d = tmp_path / "state"
    monkeypatch.setenv("STREAMQUAKE_STATE_DIR", str(d))
    return d


def free_port() -> int:
    """A loopback port free a moment ago (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamquake", *args]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cli_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or REPO)


@pytest.fixture
def reaper() -> Iterator[None]:
    """This process adopts the orphans of what the test starts (PR_SET_CHILD_SUBREAPER): a
    stopped or killed run's children that outlive it become ours, and ``reap`` tells how each
    one ended."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, ctypes.get_errno()
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap(pids: set[int] | list[int], ended: dict[int, int]) -> bool:
    """Reap whichever of ``pids`` have ended as our (adopted) children, noting their wait
    status in ``ended``; True once each is reaped here or gone (reaped by its own parent). For
    polling (tests.timing.wait_until), with the ``reaper`` fixture."""
    for pid in set(pids) - set(ended):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:       # not ours (reaped by its parent) or not yet adopted
            continue
        if got == pid:
            ended[pid] = status
    return all(not Path(f"/proc/{p}").exists() for p in set(pids) - set(ended))


def how_ended(ended: dict[int, int]) -> dict[int, object]:
    """pid -> the signal that ended it, or "exit N"."""
    return {pid: (signal.Signals(os.WTERMSIG(st)) if os.WIFSIGNALED(st)
                  else f"exit {os.WEXITSTATUS(st)}") for pid, st in ended.items()}


def listening(cmd: list[str], what: str) -> Iterator[str]:
    """Start a test server that prints ``LISTENING <url>...`` once bound; yield what follows
    LISTENING, and stop the server after."""
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        yield read_listening_line(proc, 20, what)
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module")
def echo_server() -> Iterator[str]:
    """tests/hostile_server.py on 127.0.0.1 (its /echo-* paths echo credentials back)."""
    yield from listening([sys.executable, str(REPO / "tests" / "hostile_server.py")],
                         "hostile server")
