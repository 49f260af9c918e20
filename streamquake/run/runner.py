"""The runner owns time: it starts the parts, walks warm-up, baseline, fault and recovery,
applies and reverts faults at phase edges, and asks for verdicts. It knows faults only through
the contract (``faults/contract.py``): no fault's name appears in ``run/``.

Every fault's revert is pushed on an ExitStack *before* its apply starts (so a partial apply is
undone too), and the journal records it on disk, so success, SLO failure, exceptions, Ctrl-C,
SIGTERM and even SIGKILL (through ``streamquake recover``) all end with nothing left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from streamquake.errors import (
    EXIT_NOT_JUDGED,
    EXIT_OK,
    EXIT_SLO_BROKEN,
    LeaseLapsed,
    PreflightError,
    StreamquakeError,
)
from streamquake.faults.catalog import families
from streamquake.faults.contract import FaultSpec
from streamquake.journal import Journal
from streamquake.jsontypes import JsonDict
from streamquake.loadgen.scorecard import Scorecard
from streamquake.loadgen.tail import RunSamples
from streamquake.result import Check, JudgedFault, PhaseResult, RunResult
from streamquake.run import preflight, probe
from streamquake.run.by_hand import ByHand
from streamquake.run.events import (
    Events,
    HeldByHand,
    PhaseStarted,
    RunFinished,
    RunStarted,
    Tick,
)
from streamquake.run.flapping import Flapper, attribute_states
from streamquake.run.launcher import LocustRun
from streamquake.run.lease import RunLease
from streamquake.run.ledger import WHOLE_RUN, Ledger, PlannedFault
from streamquake.run.mismatch import mismatch_checks
from streamquake.run.outcome import exit_code_for, redacted_echo
from streamquake.run.parts import start_loadgen, start_parts
from streamquake.run.recovery_time import recovery_times
from streamquake.run.saturation import SaturationGuard
from streamquake.run.scoring import proxy_drops, score
from streamquake.run.series import cdfs, environment, per_second
from streamquake.run.signals import Interrupted, Signals
from streamquake.run.stream_limits import stream_limits_check
from streamquake.run.timeline import PhaseWindow, sleep_until
from streamquake.run.verdicts import evaluate
from streamquake.run.watch import Watch
from streamquake.run.workers import summarise as summarise_workers
from streamquake.scenario import Scenario
from streamquake.scenario.advice import scenario_warnings
from streamquake.version import __version__

DEFAULT_LEASE_S = 10.0     # how long the watchdog waits for a renewal before undoing faults


class Runner:
    def __init__(self, scenario: Scenario, scenario_file: str, out_dir: Path,
                 events: Events | None = None, journal: Journal | None = None,
                 lease_s: float | None = DEFAULT_LEASE_S) -> None:
        self.scenario = scenario
        self.scenario_file = scenario_file
        self.out_dir = out_dir
        self.work_dir = out_dir / "run"
        self.events = events or Events()
        self.signals = Signals(self.events)
        self.journal = journal or Journal()
        self.ledger = Ledger(self.journal, self.signals, self.events)
        self.warnings: list[str] = []
        self.aborted: str | None = None
        self.aborted_in: str | None = None       # the step the run aborted in
        self.watch = Watch(self.work_dir / "samples", [])
        self.phase_start: float | None = None    # the live figures never reach back past it
        self.phase_name: str | None = None
        self.by_hand: ByHand | None = None       # faults others hold here meanwhile
        self._by_hand_seen: dict[str, str] = {}  # held fault id -> its name, once warned
        self.guard = SaturationGuard(self.work_dir, [], self.events)
        self.lease_s = lease_s
        self.lease: RunLease | None = None

    def run(self) -> RunResult:
        self._preflight()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        windows: list[PhaseWindow] = []
        load: LocustRun | None = None
        target_info: JsonDict = {}
        telemetry: JsonDict = {}
        interrupted: str | None = None
        failure: StreamquakeError | None = None
        stopped_at: float | None = None    # when an interruption or error ended the phases
        with self.signals:
            parts = None
            try:
                with contextlib.ExitStack() as stack:
                    # Entered first, so it is left last: the watch ends after every revert. And
                    # held before the first change (a namespace, a proxy): a run killed at any
                    # later moment leaves nothing the watchdog does not undo.
                    if self.lease_s:
                        self.lease = stack.enter_context(
                            RunLease(self.journal, self.lease_s, self.scenario.name))
                        self._wait_for_watchdog()
                        self.ledger.lease = self.lease
                    parts = start_parts(stack, self.scenario, self.work_dir, self.journal,
                                        self.events, self._check_lease)
                    target_info = parts.target_info
                    if self.scenario.target.probe:
                        self._probe(parts.wiring.load_url)
                    planned = self.ledger.plan(parts.ctx, self._implied(), [
                        (f, tuple(s.name for s in self.scenario.timeline if f.label in s.faults))
                        for f in self.scenario.faults])
                    # Whole-run faults on a stack of their own, so an abort can revert them early.
                    whole_run = stack.enter_context(contextlib.ExitStack())
                    for fault in (f for f in planned if f.phase == WHOLE_RUN):
                        self.ledger.apply(whole_run, fault)
                    load, windows = start_loadgen(stack, self.scenario, parts, self.events)
                    self.events.emit(RunStarted(self.scenario, self.out_dir, windows[0].start))
                    self.watch = Watch(self.work_dir / "samples", self.scenario.abort_when)
                    if self.scenario.load.samples == "none":
                        self.events.message("load.samples is none: no per-request lines, so no "
                                            "rolling live figures; the verdicts come from the "
                                            "load processes' scorecards")
                    self.guard = SaturationGuard(self.work_dir, windows, self.events, {
                        s.name: s.kind for s in self.scenario.timeline})
                    self.by_hand = stack.enter_context(ByHand(self.ledger.owner))
                    self._walk(windows, planned, load, whole_run)
                    self.events.message("waiting for in-flight requests to finish")
                    load.wait()
                # Lapsed at any moment, even where no tick ran (stopped past the last phase):
                # the watchdog undid the faults under the run, whose figures are not its own.
                if self.aborted is None and self.lease is not None:
                    self.aborted = self.lease.lapsed()
            except Interrupted as exc:
                interrupted = exc.signame
                stopped_at = time.time()
                self.events.message(f"{exc}: faults reverted, writing a partial report")
            except StreamquakeError as exc:
                if load is None:
                    raise  # nothing measured yet: the CLI reports it and exits with its code
                failure = exc
                stopped_at = time.time()
                self.ledger.errors.append(str(exc))
            finally:
                if parts is not None:
                    telemetry = parts.reports()
                    # A part's report may carry warnings of its own (a proxy's own errors).
                    for report in telemetry.values():
                        said = report.get("warnings") if isinstance(report, dict) else None
                        if isinstance(said, list):
                            self.warnings += [w for w in said if isinstance(w, str)]
        card, unread = load.scorecard(windows) if load is not None else (Scorecard(windows), [])
        self.warnings += unread
        result = self._result(started, windows, card, interrupted, target_info, telemetry,
                              stopped_at)
        if failure is not None:
            result.failure = str(failure)
            if result.exit_code in (EXIT_OK, EXIT_SLO_BROKEN, EXIT_NOT_JUDGED):
                result.exit_code = failure.exit_code
        return result

    def _held_by_hand(self) -> None:
        """Name the faults held by hand here (not by this run) in the live view, and warn once
        per fault: their effect is in this run's figures."""
        if self.by_hand is None:
            return
        held = self.by_hand.held()
        names = tuple(f"{f.name} ({f.type})" for f in held)
        self.events.emit(HeldByHand(names))
        for f in held:
            if f.id in self._by_hand_seen:
                continue
            self._by_hand_seen[f.id] = f.name
            where = f"step {self.phase_name}" if self.phase_name else "the run's start-up"
            warning = (f"fault '{f.name}' ({f.type}) was held by hand on {f.host} by {f.owner} "
                       f"(not by this run) in {where}: its effect is in this run's figures, "
                       "and nothing in them tells it apart")
            self.warnings.append(warning)
            self.events.message(f"warning: {warning}")

    def _probe(self, url: str) -> None:
        """Before any fault and any load: can each class stream at all? (run/probe.py)"""
        probed = probe.probe(self.scenario, url, self.work_dir)
        for p in probed:
            self.events.message(f"probe: {p.line()}")
        found = probe.problems(probed)
        if found:
            raise PreflightError([*found, "nothing was changed and no load was sent; "
                                  "`streamquake probe` repeats this check alone (set "
                                  "target.probe: false for a target meant to fail)"])

    def _preflight(self) -> None:
        problems, warnings = preflight.journal_problems(self.journal)
        problems += preflight.header_problems(self.scenario)
        problems += preflight.environment_problems()
        short, sizing = stream_limits_check(self.scenario)
        problems += short
        if not short:
            self.events.message(f"capacity: {sizing}")
        warnings += scenario_warnings(self.scenario)
        for w in warnings:
            self.events.message(f"warning: {w}")
        self.warnings += warnings
        if problems:
            raise PreflightError(problems)

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def _wait_for_watchdog(self) -> None:
        if self.lease is None:
            return
        warning = self.lease.wait_ready()
        if warning is not None:
            self.events.message(f"warning: {warning}")
            self.warnings.append(warning)

    def _implied(self) -> list[FaultSpec]:
        return [spec for family in families() for spec in family.implied(self.scenario)]

    def _walk(self, windows: list[PhaseWindow], planned: list[PlannedFault],
              load: LocustRun, whole_run: contextlib.ExitStack) -> None:
        """Each step in turn: at its start, revert the held faults it does not run and apply
        the ones it adds (a fault named by consecutive steps stays applied across them; a
        flapping one switches inside each of its steps). The held faults' stacks live on
        ``held_stack``, so an error or a signal anywhere reverts them too."""
        with contextlib.ExitStack() as held_stack:
            held: dict[int, contextlib.ExitStack] = {}
            for w in windows:
                sleep_until(w.start, load, self.work_dir, self._tick)
                self._release(held, w.name, planned)
                self.phase_start, self.phase_name = w.start, w.name
                self.events.emit(PhaseStarted(w.name, w.end - w.start, w.start))
                with contextlib.ExitStack() as phase_stack:
                    refused = self.aborted is None and not self._apply(
                        held_stack, held, planned, w.name)
                    flaps = [Flapper.plan(f, w, self.scenario.load.seed) for f in planned
                             if w.name in f.steps and f.spec.flap is not None
                             and not refused and self.aborted is None]
                    aborted_now = refused or self._flap_until(w, flaps, phase_stack, load)
                    if aborted_now:
                        held_stack.close()     # the held faults before the whole-run ones
                if aborted_now:
                    self.aborted_in = w.name
                    # The step's faults were reverted as its stacks closed; whole-run ones now.
                    whole_run.close()
                    self.events.message(f"ABORTED in {w.name}: {self.aborted}; faults "
                                        f"reverted, the remaining {self._rest_word} run "
                                        "without faults")
                    sleep_until(w.end, load, self.work_dir, self._tick)

    @property
    def _rest_word(self) -> str:
        return "phases" if self.scenario.steps is None else "steps (fault steps skipped)"

    def _release(self, held: dict[int, contextlib.ExitStack], step: str,
                 planned: list[PlannedFault]) -> None:
        """Revert the held faults that the step ``step`` does not run."""
        for key in [k for k in held if step not in planned[k].steps]:
            held.pop(key).close()

    def _apply(self, held_stack: contextlib.ExitStack, held: dict[int, contextlib.ExitStack],
               planned: list[PlannedFault], step: str) -> bool:
        """Apply the step's faults not held already; False (the run aborted) if the lease
        lapsed first."""
        try:
            for k, fault in enumerate(planned):
                if step in fault.steps and fault.spec.flap is None and k not in held:
                    held[k] = held_stack.enter_context(contextlib.ExitStack())
                    self.ledger.apply(held[k], fault, step=step)
        except LeaseLapsed as exc:
            self.aborted = str(exc)
            return False
        return True

    def _flap_until(self, w: PhaseWindow, flaps: list[Flapper], stack: contextlib.ExitStack,
                    load: LocustRun) -> bool:
        """Sleep to the window's end, switching each flapping fault at its edges (the same
        sleep, so the load's watch goes on); True if the run aborted (a lease lapsed first)."""
        while True:
            edge = min((t for f in flaps if (t := f.next_edge()) is not None), default=w.end)
            if sleep_until(min(edge, w.end), load, self.work_dir, self._tick):
                return True
            if edge >= w.end:
                return False
            try:
                for f in flaps:
                    f.switch(time.time(), self.ledger, stack)
            except LeaseLapsed as exc:
                self.aborted = str(exc)
                return True

    def _tick(self) -> bool:
        """Feed the watch; report rolling stats; True once, when an abort condition holds."""
        self.watch.poll()
        self.guard.poll()
        rolling = dataclasses.replace(self.watch.rolling(since=self.phase_start),
                                      in_flight=self.guard.in_flight(time.time()))
        self._held_by_hand()
        self.events.emit(Tick(rolling))
        if self.aborted is None and self.lease is not None and (
                lapsed := self.lease.lapsed()) is not None:
            self.aborted = lapsed
            return True
        if self.aborted is None and (reason := self.watch.abort_reason()) is not None:
            self.aborted = reason
            return True
        return False

    def _result(self, started: float, windows: list[PhaseWindow], card: Scorecard,
                interrupted: str | None, target_info: JsonDict,
                telemetry: JsonDict, stopped_at: float | None = None) -> RunResult:
        scored = score(self.scenario, windows, card,
                       proxy_drops(telemetry, self.ledger.records, windows))
        # Read once, if a stage needs the requests one by one (None: the run kept none).
        samples = (RunSamples(self.work_dir / "samples") if self.scenario.load.samples != "none"
                   else None)
        scored.warnings += attribute_states(self.ledger.records, windows, samples)
        warm = {s.name for s in self.scenario.timeline if s.kind == "warmup"}
        measured = {k: v for k, v in scored.stats.items() if k not in warm}
        times, said = recovery_times(self.scenario, windows, self.ledger.records, measured,
                                     samples)
        scored.warnings += said
        checks = evaluate(self.scenario, measured, scored.class_stats, times)
        checks, mismatch = mismatch_checks(self.scenario, measured, checks)
        scored.warnings += mismatch
        load_processes, worker_warnings = summarise_workers(self.work_dir, windows)
        client_warnings, client_checks = self.guard.mark(
            scored.phases, scored.stats, fail=self.scenario.load.saturation == "fail")
        checks += client_checks
        judged = [JudgedFault(step.name, list(step.faults),
                              before.name if before is not None else None,
                              after.name if after is not None else None)
                  for before, step, after in self.scenario.judged]
        # The harness's own trouble is never the service's: no timing of a saturated step
        # decides a verdict (run/saturation.py), whatever evaluate() found.
        self.guard.leave_unjudged(checks, judged, self.scenario.verdicts.saturated)
        _mark_stopped(scored.phases, checks, stopped_at, judged)
        if self.scenario.steps is not None and self.aborted_in is not None:
            _mark_skipped(scored.phases, checks, self.aborted_in)
        echo = redacted_echo(self.scenario)
        result = RunResult(
            scenario_name=self.scenario.name,
            scenario_file=self.scenario_file,
            scenario_echo=echo,
            tool_version=__version__,
            started_at=started,
            finished_at=time.time(),
            interrupted=interrupted,
            phases=scored.phases,
            checks=checks,
            faults=self.ledger.records,
            target=target_info,
            telemetry=telemetry,
            errors=[*self.ledger.errors, *scored.warnings, *client_warnings, *worker_warnings,
                    *self.warnings,
                    *([f"run aborted: {self.aborted}"] if self.aborted else [])],
            aborted=self.aborted,
            load_processes=load_processes,
            judged=judged,
            recovery_times=times,
            steps_form=self.scenario.steps is not None,
            timeline=per_second(card, windows, stopped_at),
            cdfs=cdfs(measured),
            environment=environment(echo),
        )
        result.exit_code = exit_code_for(result, self.ledger.revert_failed)
        self.events.emit(RunFinished(result))
        return result


def _mark_stopped(phases: list[PhaseResult], checks: list[Check], stopped_at: float | None,
                 judged: list[JudgedFault]) -> None:
    """A phase the run never reached is "not run" (its checks too: not run is not broken); the
    one it stopped in is "partial"."""
    if stopped_at is None:
        return
    not_run = set()
    for phase in phases:
        if phase.start >= stopped_at:
            phase.status = "not run"
            not_run.add(phase.name)
        elif phase.end > stopped_at:
            phase.status = "partial"
    before = {j.step: j.before for j in judged}
    for check in checks:
        base = before.get(check.judges or "", "baseline")
        if check.phase in not_run or (check.kind == "recovery" and base in not_run):
            check.ran = False
            check.passed = False


def _mark_skipped(phases: list[PhaseResult], checks: list[Check], aborted_in: str) -> None:
    """After an abort, the fault steps still to come run without their faults: "skipped", their
    checks not run (a step with no fault in it says nothing of the fault)."""
    names = [p.name for p in phases]
    later = names[names.index(aborted_in) + 1:] if aborted_in in names else []
    skipped = {p.name for p in phases if p.name in later and p.kind == "fault"}
    for phase in phases:
        if phase.name in skipped and phase.status == "complete":
            phase.status = "skipped"
    for check in checks:
        if check.phase in skipped or check.judges in skipped:
            check.ran = False
            check.passed = False
