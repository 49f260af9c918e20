"""``streamquake worker --master HOST[:PORT]``: Locust worker processes on this host for a run
whose master is elsewhere. They get the load plan from the master and send their records back
over Locust's own connection (``loadgen/relay.py``); nothing of the scenario is needed here,
only the same streamquake version and any ``${VAR}`` the target's headers name, in this
environment (secrets never cross the wire)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import FrameType

from streamquake import procs
from streamquake.errors import ScenarioError
from streamquake.loadgen.launcher import LOCUSTFILE, PLAN_ENV
from streamquake.loadgen.relay import REMOTE_ENV

DEFAULT_MASTER_PORT = 5557


def parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or "]" in port:       # no port given (or a bare IPv6 address in brackets)
        host, port = text.strip(), str(DEFAULT_MASTER_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ScenarioError(f"--master {text}: write HOST or HOST:PORT, e.g. 10.0.0.5:5557")
    return host, int(port)


def processes_option(text: str) -> int:
    if text == "auto":
        return len(os.sched_getaffinity(0))
    if not text.isdigit() or int(text) < 1:
        raise ScenarioError(f"--processes {text}: a number of processes (1 or more), or auto "
                            "(one per core)")
    return int(text)


def run_workers(master: str, processes: int) -> int:
    """Start the workers, wait for them; SIGINT/SIGTERM are passed on. Exit code: the worst."""
    host, port = parse_master(master)
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
