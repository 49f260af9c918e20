"""Child processes that never outlive us, and the ``LISTENING <url>`` handshake."""

from __future__ import annotations

import ctypes
import functools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamquake.errors import TargetError
from streamquake.killpoints import parent_killpoint

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    # The kernel kills the child when the thread that forked it dies, even by SIGKILL. SIGKILL,
    # not SIGTERM: a runner that is gone cannot score anything, so a graceful drain (Locust
    # finishing its streams, the proxy its connections) would only keep load flowing at a
    # target, and keep a dying proxy's control port half-open for `recover`, for seconds.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    parent_killpoint("spawn.forked", parent)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # A parent that died between the fork and the prctl sends no signal (we were orphaned
    # before asking for one): go as that signal would have made us.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    # Own process group, so a terminal's Ctrl-C reaches the runner first and the runner decides.
    os.setpgrp()


def spawn(cmd: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as a child that is killed (SIGKILL) if this process dies."""
    die_with_us = functools.partial(_die_with_parent, os.getpid())   # read before the fork
    return subprocess.Popen(list(cmd), preexec_fn=die_with_us, **popen_kwargs)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment plus ``extra``, with this very package importable by the child even
    when it runs from a source checkout (Locust, for one, imports its locustfile by path)."""
    env = {**os.environ, **(extra or {})}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def python_module_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def read_listening_line(proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> str:
    """Wait for the child's ``LISTENING <url>`` line on stdout; return the URL."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        if proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            raise TargetError(f"{what} exited with code {proc.returncode} before it was ready")
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            proc.wait(timeout=5)
            raise TargetError(f"{what} exited with code {proc.returncode} before it was ready")
        buf += chunk
        for line in buf.splitlines():
            if line.startswith(b"LISTENING "):
                return line.split(b" ", 1)[1].decode().strip()
    raise TargetError(f"{what} did not report ready within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout_s``. Safe to call twice."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    return proc.returncode


_TAIL_BYTES = 64 * 1024   # a child's log can be long: its last lines are in its last bytes


def log_tail(log: Path | int, lines: int) -> list[str]:
    """The last ``lines`` complete lines of a log, given by path or by an open descriptor (which
    is left open); undecodable bytes replaced. Raises OSError if it cannot be read."""
    with open(log, "rb", closefd=not isinstance(log, int)) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_BYTES))
        text = f.read().decode(errors="replace").splitlines()
    return (text[1:] if size > _TAIL_BYTES else text)[-lines:] if lines > 0 else []
