"""The runner owns time: it starts the parts, walks warm-up, baseline, fault and recovery,
applies and reverts faults at phase edges, and asks ``slo`` for verdicts.

Every fault's revert is pushed on an ExitStack *before* its apply starts (so a partial apply is
undone too), and the journal records it on disk, so success, SLO failure, exceptions, Ctrl-C,
SIGTERM and even SIGKILL (through ``streamquake recover``) all end with nothing left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from streamquake import __version__
from streamquake.deadline import run_with_deadline
from streamquake.errors import (
    EXIT_ENVIRONMENT,
    EXIT_OK,
    EXIT_REVERT_FAILED,
    EXIT_SLO_BROKEN,
    InjectorError,
    PreflightError,
    StreamquakeError,
)
from streamquake.events import Events
from streamquake.injectors.base import RunContext, injector_class
from streamquake.journal import Journal
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.result import FaultRecord, PhaseResult, RunResult
from streamquake.scenario import ENV_REF, PHASE_ORDER, Scenario
from streamquake.slo import evaluate

STARTUP_LEAD_S = 3.0        # time the load process gets to import Locust and spawn users
REVERT_TIMEOUT_S = 30.0


class Interrupted(Exception):
    def __init__(self, signame: str) -> None:
        super().__init__(f"interrupted by {signame}")
        self.signame = signame


@dataclass(frozen=True)
class PhaseWindow:
    name: str
    start: float
    end: float


def plan_windows(scenario: Scenario, t0: float) -> list[PhaseWindow]:
    windows, t = [], t0
    for phase in PHASE_ORDER:
        d = scenario.phases.duration_s(phase)
        if d > 0:
            windows.append(PhaseWindow(phase, t, t + d))
            t += d
    return windows


def assign_phases(
    samples: list[RequestSample], windows: list[PhaseWindow]
) -> tuple[dict[str, list[RequestSample]], dict[str, int]]:
    """A request belongs to the phase in which it was due (open loop) or sent (closed loop),
    and is scored there only if it also ended within that phase: a stream that straddles a
    phase edge saw two different worlds (a fault applied or reverted mid-stream) and would
    smear one phase's damage into the other. Returns (scored samples, straddlers) per phase."""
    scored: dict[str, list[RequestSample]] = {w.name: [] for w in windows}
    straddled = {w.name: 0 for w in windows}
    for s in samples:
        t = s.scheduled if s.scheduled is not None else s.sent
        for w in windows:
            if w.start <= t < w.end:
                ended = s.sent + (s.e2e_ms or 0.0) / 1000.0
                if ended <= w.end:
                    scored[w.name].append(s)
                else:
                    straddled[w.name] += 1
                break
    return scored, straddled


class _Signals:
    """SIGINT/SIGTERM become ``Interrupted``, but never inside ``shield()``: a signal that
    arrives while a fault is being reverted is held until the revert is done, so a second
    Ctrl-C cannot cancel a revert."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.shielded = False
        self.raised: str | None = None       # the signal already turned into Interrupted
        self.held: str | None = None         # one that arrived while shielded
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.shielded or self.raised:
            self.held = self.held or name
            self.events.emit("message", f"{name} received: still reverting faults, please wait")
            return
        self.raised = name
        raise Interrupted(name)

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        before, self.shielded = self.shielded, True
        try:
            yield
        finally:
            self.shielded = before
        if self.held and not self.raised and not before:
            self.raised = self.held
            raise Interrupted(self.held)

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Runner:
    def __init__(
        self,
        scenario: Scenario,
        scenario_file: str,
        out_dir: Path,
        events: Events | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.scenario = scenario
        self.scenario_file = scenario_file
        self.out_dir = out_dir
        self.work_dir = out_dir / "run"
        self.events = events or Events()
        self.signals = _Signals(self.events)
        self.journal = journal or Journal()
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []
        self.revert_failed = False
        self.target_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ entry point

    def run(self) -> RunResult:
        self._refuse_if_journal_pending()
        self._check_header_variables()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        windows: list[PhaseWindow] = []
        load = None
        telemetry: dict[str, Any] = {}
        interrupted: str | None = None
        failure: StreamquakeError | None = None
        with self.signals:
            try:
                with contextlib.ExitStack() as stack:
                    ctx = self._start_parts(stack)
                    injectors = self._build_injectors(ctx)
                    for spec, inj in self._whole_run_faults(ctx):
                        self._apply(stack, spec, inj, phase="whole run")
                    self._start_telemetry(stack, telemetry)
                    self.events.emit("run_started", self.scenario, self.out_dir)
                    t0 = time.time() + STARTUP_LEAD_S
                    windows = plan_windows(self.scenario, t0)
                    load = self._start_load(stack, ctx, t0, windows[-1].end)
                    self._walk(windows, injectors, load)
                    self._finish_load(load)
            except Interrupted as exc:
                interrupted = exc.signame
                self.events.emit("message", f"{exc}: faults reverted, writing a partial report")
            except StreamquakeError as exc:
                if load is None:
                    raise  # nothing measured yet: the CLI reports it and exits with its code
                failure = exc
                self.errors.append(str(exc))
        samples = load.samples() if load is not None else []
        result = self._result(started, windows, samples, interrupted, telemetry)
        if failure is not None and result.exit_code in (EXIT_OK, EXIT_SLO_BROKEN):
            result.exit_code = failure.exit_code
        return result

    # ------------------------------------------------------------------ parts

    def _refuse_if_journal_pending(self) -> None:
        pending = self.journal.entries()
        if pending:
            names = ", ".join(f"{e['name']} ({e['type']}, pid {e['pid']})" for e in pending)
            raise PreflightError(
                f"the fault journal {self.journal.path} lists {len(pending)} fault(s) that were "
                f"never reverted: {names}; run `streamquake recover` first"
            )

    def _check_header_variables(self) -> None:
        missing = sorted(
            {name for value in self.scenario.target.headers.values()
             for name in ENV_REF.findall(value) if name not in os.environ}
        )
        if missing:
            raise PreflightError(
                f"target.headers refer to environment variable(s) that are not set: "
                f"{', '.join(missing)}; export them before the run"
            )

    def _start_parts(self, stack: contextlib.ExitStack) -> RunContext:
        spec = self.scenario.target
        netns: str | None = None
        cmd_prefix: list[str] | None = None
        bind_host = "127.0.0.1"
        if self.scenario.network.mode == "namespace":
            from streamquake.netns import NamespaceTopology

            if spec.embedded is None:
                raise PreflightError(
                    "network mode 'namespace' runs the embedded target in its own namespace; "
                    "with a 'url' target use mode 'host' and a scope"
                )
            topo = stack.enter_context(NamespaceTopology.for_run(self.scenario.network))
            netns, cmd_prefix, bind_host = topo.name, topo.cmd_prefix(), topo.target_addr
        if spec.embedded is not None:
            from streamquake.target.process import start_target

            self.events.emit("message", "starting the embedded target")
            target = stack.enter_context(
                start_target(
                    spec.embedded,
                    host=bind_host,
                    cmd_prefix=cmd_prefix,
                    log_path=self.work_dir / "target.log",
                )
            )
            target_url = target.url
            self.target_info = {"kind": "embedded", "url": target_url,
                                "config": spec.embedded.model_dump(mode="json")}
        else:
            assert spec.url is not None
            target_url = spec.url
            self._check_reachable(target_url, spec.connect_timeout_s)
            self.target_info = {"kind": "url", "url": target_url}
        parts = urlsplit(target_url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        proxy_control = None
        self.load_url = target_url
        if any(f.type == "sse_proxy" for f in self.scenario.faults):
            from streamquake.injectors.proxy_server import start_proxy

            self.events.emit("message", "starting the SSE fault proxy")
            proxy = stack.enter_context(
                start_proxy(
                    target_url,
                    seed=self.scenario.load.seed,
                    insecure=not spec.verify_tls,
                    log_path=self.work_dir / "proxy.log",
                )
            )
            proxy_control = proxy.control_url
            self.load_url = proxy.url
            self.target_info["proxy_url"] = proxy.url
        return RunContext(
            target_host=host,
            target_port=port,
            run_dir=self.work_dir,
            proxy_control_url=proxy_control,
            target_netns=netns,
            extra={"network": self.scenario.network},
        )

    @staticmethod
    def _check_reachable(url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
                pass
        except OSError as exc:
            raise PreflightError(
                f"target {parts.scheme}://{parts.hostname}:{port} is unreachable "
                f"({exc.strerror or exc}); is it running, and is the URL right?"
            ) from exc

    def _build_injectors(self, ctx: RunContext) -> list[tuple[Any, Any]]:
        built = []
        problems: list[str] = []
        for spec in self.scenario.faults:
            inj = injector_class(spec.type)(spec, ctx)
            problems += [f"fault '{spec.label}' ({spec.type}): {p}" for p in inj.preflight()]
            built.append((spec, inj))
        if problems:
            raise PreflightError(problems)
        return built

    def _whole_run_faults(self, ctx: RunContext) -> list[tuple[Any, Any]]:
        """A network profile (``network.profile``) shapes the path for the whole run."""
        from streamquake.injectors.netem import NetemInjector, network_profile_fault

        spec = network_profile_fault(self.scenario.network)
        if spec is None:
            return []
        inj = NetemInjector(spec, ctx)
        problems = inj.preflight()
        if problems:
            raise PreflightError([f"network profile '{spec.label}': {p}" for p in problems])
        return [(spec, inj)]

    def _start_telemetry(self, stack: contextlib.ExitStack, telemetry: dict[str, Any]) -> None:
        from streamquake.gpu_telemetry import GpuSampler

        if not GpuSampler.available():
            telemetry["gpu"] = {"available": False}
            return
        sampler = GpuSampler(interval_s=1.0)
        sampler.start()

        def _stop() -> None:
            telemetry["gpu"] = {"available": True, "samples": sampler.stop()}

        stack.callback(_stop)

    def _start_load(
        self, stack: contextlib.ExitStack, ctx: RunContext, t0: float, end_at: float
    ) -> Any:
        from streamquake.loadgen.launcher import start_load

        self.events.emit("message", "starting the load generator (Locust)")
        run = start_load(
            self.scenario,
            base_url=self.load_url,
            work_dir=self.work_dir,
            end_at=end_at,
            run_time_s=end_at - time.time(),
        )
        stack.callback(run.stop)
        return run

    # ------------------------------------------------------------------ time

    def _walk(self, windows: list[PhaseWindow], injectors: list[tuple[Any, Any]],
              load: Any) -> None:
        for w in windows:
            self._sleep_until(w.start, load)
            self.events.emit("phase_started", w.name, w.end - w.start)
            with contextlib.ExitStack() as phase_stack:
                for spec, inj in injectors:
                    if spec.phase == w.name:
                        self._apply(phase_stack, spec, inj)
                self._sleep_until(w.end, load)

    def _sleep_until(self, deadline: float, load: Any) -> None:
        while (left := deadline - time.time()) > 0:
            if not load.alive():
                raise StreamquakeError(
                    f"the load generator stopped early (code {load.returncode()}); "
                    f"see {self.work_dir / 'locust.log'}"
                )
            time.sleep(min(0.2, left))

    def _apply(self, stack: contextlib.ExitStack, spec: Any, inj: Any,
               phase: str | None = None) -> None:
        record = FaultRecord(name=spec.label, type=spec.type, phase=phase or spec.phase,
                             configured=inj.describe())
        self.records.append(record)
        entry = self.journal.add(spec.type, spec.label)
        stack.callback(self._revert, record, inj, entry)
        try:
            record.applied = inj.apply(entry)
        except InjectorError as exc:
            record.error = f"apply failed: {exc}"
            raise
        record.applied_at = time.time()
        self.events.emit("fault_applied", record)

    def _revert(self, record: FaultRecord, inj: Any, entry: Any) -> None:
        with self.signals.shield():
            self._revert_shielded(record, inj, entry)

    def _revert_shielded(self, record: FaultRecord, inj: Any, entry: Any) -> None:
        try:
            record.reverted = run_with_deadline(
                inj.revert, REVERT_TIMEOUT_S, f"reverting {record.name}"
            )
        except Exception as exc:  # noqa: BLE001 - a failed revert must never stop other reverts
            self.revert_failed = True
            record.error = (record.error + "; " if record.error else "") + f"revert failed: {exc}"
            self.errors.append(
                f"fault '{record.name}' may still be in place ({exc}); "
                "run `streamquake recover` to retry"
            )
            self.events.emit("fault_reverted", record)
            return
        record.reverted_at = time.time()
        entry.done()
        self.events.emit("fault_reverted", record)

    def _finish_load(self, load: Any) -> None:
        self.events.emit("message", "waiting for in-flight requests to finish")
        load.wait()

    # ------------------------------------------------------------------ verdicts

    def _result(self, started: float, windows: list[PhaseWindow], samples: list[RequestSample],
                interrupted: str | None, telemetry: dict[str, Any]) -> RunResult:
        by_phase, straddled = assign_phases(samples, windows)
        phase_stats: dict[str, Stats] = {}
        class_stats: dict[str, dict[str, Stats]] = {}
        phases = []
        for w in windows:
            phase_samples = by_phase[w.name]
            phase_stats[w.name] = Stats.from_samples(phase_samples)
            class_stats[w.name] = {
                rc.name: Stats.from_samples([s for s in phase_samples if s.cls == rc.name])
                for rc in self.scenario.load.classes
            }
            if straddled[w.name] > len(phase_samples) and w.name != "warmup":
                self.errors.append(
                    f"phase {w.name}: {straddled[w.name]} requests straddled its end and were "
                    f"not scored, more than the {len(phase_samples)} that were; make the phase "
                    "longer than a few request durations"
                )
            phases.append(
                PhaseResult(
                    name=w.name, start=w.start, end=w.end,
                    stats={**phase_stats[w.name].to_dict(), "straddled": straddled[w.name]},
                    classes={k: v.to_dict() for k, v in class_stats[w.name].items()},
                )
            )
        scored = {k: v for k, v in phase_stats.items() if k != "warmup"}
        checks = evaluate(self.scenario, scored, class_stats)
        result = RunResult(
            scenario_name=self.scenario.name,
            scenario_file=self.scenario_file,
            scenario_echo=redacted_echo(self.scenario),
            tool_version=__version__,
            started_at=started,
            finished_at=time.time(),
            interrupted=interrupted,
            phases=phases,
            checks=checks,
            faults=self.records,
            target=self.target_info,
            telemetry=telemetry,
            errors=self.errors,
        )
        result.exit_code = exit_code_for(result, self.revert_failed)
        self.events.emit("run_finished", result)
        return result


def exit_code_for(result: RunResult, revert_failed: bool) -> int:
    if revert_failed:
        return EXIT_REVERT_FAILED
    if result.interrupted:
        return 130 if result.interrupted == "SIGINT" else 143
    if any(f.error for f in result.faults):
        return EXIT_ENVIRONMENT
    return EXIT_SLO_BROKEN if result.broken else EXIT_OK


def redacted_echo(scenario: Scenario) -> dict[str, Any]:
    """The scenario as run, with every header value hidden: they carry credentials."""
    echo = scenario.model_dump(mode="json", by_alias=True)
    echo["target"]["headers"] = {k: "<redacted>" for k in echo["target"].get("headers", {})}
    return echo
