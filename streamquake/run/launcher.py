"""Start Locust in its own process(es) with a load plan, and collect the samples it writes.

Imported by the runner, so it must never import locust or gevent (locust monkey-patches the
standard library at import). Locust's own master/worker mode spreads users over processes;
each process appends its samples to ``<samples dir>/samples-<pid>.jsonl``, and the open-loop
arrivals it never sent to ``<samples dir>/unsent-<pid>.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

from streamquake import procs
from streamquake.errors import StreamquakeError
from streamquake.jsontypes import JsonDict
from streamquake.loadgen.attribution import WindowLike
from streamquake.loadgen.plan import (
    LOCUSTFILE,
    PLAN_ENV,
    PLAN_FILE_WAIT_S,
    READY_PREFIX,
    LoadPlan,
    lift_literal_secrets,
    write_plan,
)
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.loadgen.scorecard import Scorecard, read_scorecards

if TYPE_CHECKING:
    from streamquake.scenario import Scenario

W = TypeVar("W", bound=WindowLike)
_WORKERS_MAX_WAIT_S = 30
_WAIT_GRACE_S = 30.0
_RUN_TIME_BACKSTOP_S = 15.0
# From every load process up to the first step: the users' start (Locust spawns them once its
# init is done, a few ms later here) and the plan's read.
BEGIN_AFTER_READY_S = 0.5
# How long the runner waits for the load processes to come up before it sets the steps' times
# anyway (a Locust still importing then starts its users late, and the run says so).
READY_WAIT_S = 60.0


class LocustRun:
    """Locust processes of one run: the first is the standalone or master process."""

    def __init__(self, processes: list[subprocess.Popen[bytes]], logs: list[IO[bytes]],
                 samples_dir: Path, expected_end: float, cards_dir: Path | None = None,
                 keep_cards: Path | None = None) -> None:
        self._processes = processes
        self._logs = logs
        self.samples_dir = samples_dir
        self.expected_end = expected_end    # when Locust's --run-time and --stop-timeout expire
        self.cards_dir = cards_dir or samples_dir   # where the processes put their scorecards
        self.keep_cards = keep_cards        # where they are kept once read (a scratch dir's)
        self.plan_path: Path | None = None  # a plan written later (start_locust(plan_later))
        self.lifted: dict[str, str] = {}    # the literal secrets the processes were given
        self.up: tuple[int, float] | None = None   # (processes up, seconds it took): wait_ready

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def alive(self) -> bool:
        return self._processes[0].poll() is None

    def returncode(self) -> int | None:
        return self._processes[0].poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for Locust to finish on its own; stop it if it has not after ``timeout`` s.

        The default allows its run time, stop timeout and a grace. Returns the exit code of the
        standalone or master process.
        """
        if timeout is None:
            timeout = max(0.0, self.expected_end - time.time()) + _WAIT_GRACE_S
        deadline = time.time() + timeout
        # The master first; its workers may still be finishing their last streams after it.
        for proc in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.time()))
        self.stop()
        return self._processes[0].returncode

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until every load process started here says it is up and waits for its plan
        (``ready-<pid>`` beside the plan's path), one has exited (the runner reports it), or
        ``timeout_s`` has passed; return the time then."""
        assert self.plan_path is not None, "start_locust(plan_later=True) starts them so"
        markers = [self.plan_path.with_name(f"{READY_PREFIX}{p.pid}") for p in self._processes]
        started, deadline = time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(m.exists() for m in markers) or any(
                    p.poll() is not None for p in self._processes):
                break
            time.sleep(0.01)
        self.up = (sum(m.exists() for m in markers), time.monotonic() - started)
        return time.time()

    def begin(self, plan: LoadPlan) -> None:
        """Write the plan the processes wait for (``start_locust(plan_later=True)``): its steps'
        times set now that they are up. Its literal secrets are lifted as they were at the
        start, into the variables the processes were given then."""
        assert self.plan_path is not None, "start_locust(plan_later=True) starts them so"
        plan, lifted = lift_literal_secrets(plan)
        if lifted != self.lifted:
            raise StreamquakeError("the load plan's credentials changed between the load "
                                   "processes' start and their plan")
        write_plan(self.plan_path, plan)
        for marker in self.plan_path.parent.glob(f"{READY_PREFIX}*"):
            marker.unlink(missing_ok=True)     # read by now: nothing of the run's output
        self.expected_end = plan.end_at + math.ceil(plan.timeout_s) + _RUN_TIME_BACKSTOP_S

    def stop(self) -> None:
        """SIGTERM (Locust stops its users and prints its summary), then SIGKILL. Idempotent."""
        for proc in self._processes:   # the master first: it tells its workers to quit
            procs.stop(proc, timeout_s=10.0)
        for log in self._logs:
            log.close()

    def samples(self) -> list[RequestSample]:
        """Every sample written so far, from all processes; a torn last line is skipped."""
        return [RequestSample.from_dict(d) for d in _records(self.samples_dir, "samples")]

    def scorecard(self, windows: Sequence[WindowLike]) -> tuple[Scorecard, list[str]]:
        """Every load process's scorecard for these windows, merged (loadgen/scorecard.py),
        and the problems with them. Cards in a scratch folder are then copied beside the
        reports (``run/scorecards/``, where the disk allows) and the scratch folder removed."""
        merged = read_scorecards(self.cards_dir, windows)
        if self.keep_cards is not None and self.cards_dir != self.samples_dir:
            with contextlib.suppress(OSError):
                self.keep_cards.mkdir(parents=True, exist_ok=True)
                for path in sorted([*self.cards_dir.glob("scorecard-*.json"),
                                    *self.cards_dir.glob("seconds-*.jsonl")]):
                    shutil.copyfile(path, self.keep_cards / path.name)
            shutil.rmtree(self.cards_dir, ignore_errors=True)
        return merged

    def unsent(self) -> list[UnsentArrival]:
        """Every open-loop arrival that was due but never sent, from all processes."""
        out = []
        for d in _records(self.samples_dir, "unsent"):
            try:
                out.append(UnsentArrival.from_dict(d))
            except TypeError:
                continue   # a line from some other writer: not ours to count
        return out


def _records(samples_dir: Path, prefix: str) -> list[JsonDict]:
    out: list[JsonDict] = []
    for path in sorted(samples_dir.glob(f"{prefix}-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue   # only a process killed mid-write leaves such a line
                if isinstance(record, dict):
                    out.append(record)
    return out


def start_locust(
    plan: LoadPlan,
    run_dir: Path,
    run_time_s: float,
    *,
    workers: int = 0,
    remote_workers: int = 0,
    master_bind: str = "127.0.0.1:5557",
    stop_timeout_s: float | None = None,
    plan_later: bool = False,
) -> LocustRun:
    """Start ``locust --headless`` (or a master and ``workers`` workers) on ``plan``.

    The plan goes to ``run_dir/load-plan.json`` (header values stay ``${VAR}`` templates: the
    load process expands them), logs to ``run_dir/locust.log`` (and ``locust-worker-N.log``).
    ``stop_timeout_s`` (default: the plan's request timeout) is how long Locust lets in-flight
    streams finish once its run time is up. ``plan_later``: the plan is not written yet; the
    processes wait for it once up, and ``LocustRun.wait_ready`` and ``begin`` (with the final
    plan, its users and credentials those of ``plan``) follow.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_dir = Path(plan.samples_path)
    samples_dir.mkdir(parents=True, exist_ok=True)
    plan_path = run_dir / "load-plan.json"
    # No secret on disk: credentials written literally go to the load processes' environment.
    plan, lifted = lift_literal_secrets(plan)
    if plan_later:
        plan_path.unlink(missing_ok=True)
        for stale in run_dir.glob(f"{READY_PREFIX}*"):
            stale.unlink(missing_ok=True)
    else:
        write_plan(plan_path, plan)
    # Whole seconds: Locust's --stop-timeout takes no fraction (a 1.8 s timeout waits 2 s).
    stop_timeout = math.ceil(plan.timeout_s if stop_timeout_s is None else stop_timeout_s)
    # The locustfile ends the run at the plan's end_at itself (gracefully, waiting for remote
    # workers' last records); Locust's own --run-time is only a backstop after that.
    run_time = max(1, math.ceil(run_time_s + stop_timeout + _RUN_TIME_BACKSTOP_S))
    common = ["-f", str(LOCUSTFILE)]
    main = [
        *common, "--headless", "-u", str(plan.users), "-r", f"{plan.spawn_rate:g}",
        "--run-time", f"{run_time}s", "--stop-timeout", f"{stop_timeout:g}",
        "--only-summary", "--exit-code-on-error", "0",
    ]
    env = procs.child_env({PLAN_ENV: str(plan_path), **lifted})
    launches: list[tuple[list[str], Path]] = []
    if workers > 0 or remote_workers > 0:
        host, port = "127.0.0.1", _free_port()
        if remote_workers > 0:
            bind_host, _, bind_port = master_bind.rpartition(":")
            host, port = bind_host.strip("[]"), int(bind_port)
        main += ["--master", "--master-bind-host", host, "--master-bind-port", str(port),
                 "--expect-workers", str(workers + remote_workers),
                 "--expect-workers-max-wait", str(_WORKERS_MAX_WAIT_S)]
        launches.append((main, run_dir / "locust.log"))
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        worker = [*common, "--worker", "--master-host", local, "--master-port", str(port)]
        launches += [(worker, run_dir / f"locust-worker-{i}.log") for i in range(workers)]
    else:
        launches.append((main, run_dir / "locust.log"))
    cards_dir = Path(plan.scorecards_path) if plan.scorecards_path else None
    run = LocustRun([], [], samples_dir, time.time() + run_time, cards_dir,
                    run_dir / "scorecards")
    run.lifted = lifted
    if plan_later:
        run.plan_path = plan_path
    try:
        for args, log_path in launches:
            log = open(log_path, "ab")  # noqa: SIM115 - closed by LocustRun.stop
            run._logs.append(log)
            run._processes.append(procs.spawn(
                procs.python_module_cmd("locust", *args),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            ))
    except OSError as exc:
        run.stop()
        raise StreamquakeError(f"cannot start Locust ({exc}); is it installed?") from exc
    return run


def start_load(
    scenario: Scenario, *, base_url: str, work_dir: Path,
    windows_from: Callable[[float], list[W]], least_lead_s: float = 0.0,
) -> tuple[LocustRun, list[W]]:
    """The runner's entry: a scenario's load against ``base_url``, and its steps' windows.

    The load processes start first; once each says it is up (or READY_WAIT_S has passed) the
    windows are set, ``windows_from(t)`` with the first step opening BEGIN_AFTER_READY_S later
    (and no sooner than ``least_lead_s`` after the start: remote workers' time to join), and
    the plan the processes wait for is written. No lead is guessed: a Locust that came up in
    1.5 s starts its steps then, one that took 6 s on a busy machine still has its first step."""
    from streamquake.run.load_from_scenario import load_plan_for

    # Scorecards are the runner's input, not a report: they go to a scratch folder off the
    # --out disk, so a report disk that fills up cannot cost the verdicts.
    cards = Path(tempfile.mkdtemp(prefix="streamquake-scorecards-"))
    started = time.time()
    # The plan's users and credentials (the command line and environment the processes are
    # started with) do not depend on the steps' times: these are only a first guess.
    guess = windows_from(started + READY_WAIT_S)
    plan = load_plan_for(scenario, base_url, work_dir / "samples", guess[-1].end, guess, cards)
    try:
        run = start_locust(plan, work_dir, guess[-1].end - started + PLAN_FILE_WAIT_S,
                           workers=scenario.load.workers,
                           remote_workers=scenario.load.remote_workers,
                           master_bind=scenario.load.master_bind, plan_later=True)
    except BaseException:
        shutil.rmtree(cards, ignore_errors=True)
        raise
    try:
        up = run.wait_ready(READY_WAIT_S)
        windows = windows_from(max(up + BEGIN_AFTER_READY_S, started + least_lead_s))
        run.begin(load_plan_for(scenario, base_url, work_dir / "samples", windows[-1].end,
                                windows, cards))
    except BaseException:
        run.stop()
        shutil.rmtree(cards, ignore_errors=True)
        raise
    return run, windows


def _free_port() -> int:
    # Locust's master cannot bind port 0 and report it, so pick a free one just before.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
