"""Run the embedded target as a child process and wait until it answers ``/healthz``."""

from __future__ import annotations

import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO

from streamquake import procs
from streamquake.embedded.config import TargetConfig
from streamquake.errors import TargetError

_STDERR_TAIL_LINES = 20


class TargetProcess:
    """A running target. Use as a context manager, or call ``stop()``; stopping twice is safe."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, stderr: IO[bytes]) -> None:
        self.proc = proc
        self.url = url
        self._stderr = stderr

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, lines: int = _STDERR_TAIL_LINES) -> str:
        """The last lines the target wrote to stderr."""
        return _tail(self._stderr, lines)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        code = procs.stop(self.proc, timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return code

    def __enter__(self) -> TargetProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _tail(stream: IO[bytes], lines: int) -> str:
    if stream.closed:
        return ""
    try:
        stream.flush()
        return "\n".join(procs.log_tail(stream.fileno(), lines))
    except OSError:
        return ""


def _healthy(url: str, timeout_s: float) -> bool:
    # The target's certificate is usually self-signed; readiness is all we check here.
    ctx = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(url: str, timeout_s: float) -> None:
    """Poll ``GET /healthz`` until it answers 200; raise TargetError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TargetError(
                f"the target at {url} did not answer /healthz within {timeout_s:.0f} s"
            )
        if _healthy(url, min(2.0, left)):
            return
        time.sleep(0.05)


def target_cmd(config: TargetConfig, host: str, port: int) -> list[str]:
    return procs.python_module_cmd(
        "streamquake.embedded",
        "--host", host,
        "--port", str(port),
        "--config-json", config.model_dump_json(by_alias=True),
    )


def start_target(
    config: TargetConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    cmd_prefix: list[str] | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 15.0,
    log_path: str | Path | None = None,
    health_check: bool = True,
) -> TargetProcess:
    """Start ``python -m streamquake.embedded`` and return once it is bound and healthy.

    ``cmd_prefix`` runs it under another command (``["ip", "netns", "exec", "ns1"]``); set
    ``health_check=False`` when this process cannot reach the address it binds. ``env`` adds to
    our environment. Its stderr goes to ``log_path`` if given, else to an anonymous temp file;
    either way the last lines are quoted when it fails to start.
    """
    cmd = [*(cmd_prefix or []), *target_cmd(config, host, port)]
    stderr: IO[bytes] = (
        open(log_path, "ab") if log_path is not None else tempfile.TemporaryFile()  # noqa: SIM115
    )
    try:
        proc = procs.spawn(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=procs.child_env(env),
        )
    except OSError as exc:
        stderr.close()
        raise TargetError(f"cannot start the target ({cmd[0]}): {exc}") from exc
    target = TargetProcess(proc, "", stderr)
    try:
        target.url = procs.read_listening_line(proc, ready_timeout_s, "the target")
        if health_check:
            wait_healthy(target.url, ready_timeout_s)
    except TargetError as exc:
        tail = target.stderr_tail()
        target.stop()
        detail = f"\n--- target stderr (last lines) ---\n{tail}" if tail else ""
        raise TargetError(f"{exc}{detail}") from exc
    return target
