"""``streamquake worker --master HOST[:PORT]``: Locust worker processes on this host for a run
whose master is elsewhere. They get the load plan from the master and send their records back
over Locust's own connection (``loadgen/relay.py``); nothing of the scenario is needed here,
only the same streamquake version and any ``${VAR}`` the target's headers name, in this
environment (those secrets never cross the wire; a credential the scenario writes literally
comes with the plan, as ``loadgen/plan.py`` lifts it)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import time
from types import FrameType

from streamquake import procs
from streamquake.errors import PreflightError, ScenarioError
from streamquake.loadgen.plan import LOCUSTFILE, PLAN_ENV
from streamquake.loadgen.relay import REMOTE_ENV
from streamquake.units import format_duration

DEFAULT_MASTER_PORT = 5557


def parse_master(text: str, option: str = "--master") -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or "]" in port:       # no port given (or a bare IPv6 address in brackets)
        host, port = text.strip(), str(DEFAULT_MASTER_PORT)
    host = host.strip("[]")
    if (not host or not port.isascii() or not port.isdigit() or len(port) > 5
            or not 0 < int(port) < 65536 or not _host_name_ok(host)):
        raise ScenarioError(f"{option} {text[:80]}: write HOST or HOST:PORT (a port 1-65535, "
                            "a host name of at most 253 characters), e.g. 10.0.0.5:5557")
    return host, int(port)


def _host_name_ok(host: str) -> bool:
    """A name the resolver can take: an IP address, or labels of 1-63 characters (IDNA)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        return len(host.encode("idna")) <= 253
    except UnicodeError:
        return False


def processes_option(text: str, option: str = "--processes") -> int:
    if text == "auto":
        return len(os.sched_getaffinity(0))
    if not text.isdigit() or int(text) < 1:
        raise ScenarioError(f"{option} {text}: a number of processes (1 or more), or auto "
                            "(one per core)")
    return int(text)


def wait_for_master(host: str, port: int, timeout_s: float) -> None:
    """Wait until the master's port takes a connection: Locust's own worker would retry for
    five minutes, logging each try. PreflightError (exit 3) once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))).close()
            return
        except OSError as exc:
            if left <= 0:
                raise PreflightError(
                    f"no run's master answered at {host}:{port} within "
                    f"{format_duration(timeout_s)} ({exc.strerror or exc}): start `streamquake "
                    "run --remote-workers N --master-bind HOST:PORT` there, or give "
                    "--connect-timeout a longer time") from None
        time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))


def run_workers(master: str, processes: int, connect_timeout_s: float = 60.0) -> int:
    """Once the master answers, start the workers and wait for them; SIGINT/SIGTERM are passed
    on. Exit code: the worst."""
    host, port = parse_master(master)
    wait_for_master(host, port, connect_timeout_s)
    env = procs.child_env({REMOTE_ENV: "1"})
    env.pop(PLAN_ENV, None)
    cmd = procs.python_module_cmd("locust", "-f", str(LOCUSTFILE), "--worker",
                                  "--master-host", host, "--master-port", str(port))
    children = [procs.spawn(cmd, stdin=subprocess.DEVNULL, env=env) for _ in range(processes)]
    print(f"streamquake worker: {processes} Locust worker process(es) "
          f"({', '.join(str(c.pid) for c in children)}) for the master at {host}:{port}",
          flush=True)

    def forward(signum: int, _: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    codes = []
    for child in children:
        while True:
            try:
                codes.append(child.wait())
                break
            except InterruptedError:
                time.sleep(0.05)
    return max(codes, default=0)
