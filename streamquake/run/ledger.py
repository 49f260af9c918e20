"""Applying and reverting faults: journal first, revert registered before apply, a record of
each for the report. Knows faults only through the contract."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass

from streamquake.deadline import run_with_deadline
from streamquake.errors import InjectorError, LeaseLapsed, PreflightError
from streamquake.faults.catalog import fault_type
from streamquake.faults.contract import Describes, FaultSpec, Injector, RunContext
from streamquake.faults.written import settings_text
from streamquake.journal import Journal, JournalEntry
from streamquake.jsontypes import JsonDict
from streamquake.killpoints import killpoint
from streamquake.result import FaultRecord, FlapEdge
from streamquake.run.events import Events, FaultApplied, FaultReverted
from streamquake.run.lease import RunLease
from streamquake.run.preflight import injector_problems
from streamquake.run.signals import Signals

REVERT_TIMEOUT_S = 30.0
WHOLE_RUN = "whole run"


@dataclass
class PlannedFault:
    spec: FaultSpec
    injector: Injector
    phase: str                     # the first step it runs in, or WHOLE_RUN
    journal_type: str | None = None   # the journal entry's type, if not the fault's (remote)
    steps: tuple[str, ...] = ()    # every step it runs in (held across consecutive ones)

    def describe(self) -> JsonDict:
        if isinstance(self.injector, Describes):
            return self.injector.describe()
        # The default report shape: the spec as the scenario gave it, with its envelope.
        described: JsonDict = self.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        return described


class Ledger:
    def __init__(self, journal: Journal, signals: Signals, events: Events) -> None:
        self.journal = journal
        self.signals = signals
        self.events = events
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []
        self.revert_failed = False
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.lease: RunLease | None = None       # the watchdog's, when one holds this run
        self._held: set[str] = set()             # journal entry ids of faults applied, held

    def plan(self, ctx: RunContext, implied: list[FaultSpec],
             listed: list[tuple[FaultSpec, tuple[str, ...]]]) -> list[PlannedFault]:
        """Build every injector and run every preflight; raise once with all problems.
        ``listed``: each scenario fault with the steps it runs in."""
        planned, problems = [], []
        for spec, steps in [*((s, (WHOLE_RUN,)) for s in implied), *listed]:
            phase = steps[0]
            type_name = spec.type
            if spec.at is not None:    # held by an agent elsewhere (streamquake/run/remote.py)
                from streamquake.faults.agent_lease import JOURNAL_TYPE
                from streamquake.run.remote import remote_injector

                remote = remote_injector(spec, ctx, self.owner)
                problems += injector_problems(spec.label, type_name, remote)
                planned.append(PlannedFault(spec, remote, phase, JOURNAL_TYPE, steps))
                continue
            injector = fault_type(type_name).injector()(spec, ctx)
            problems += injector_problems(spec.label, type_name, injector)
            planned.append(PlannedFault(spec, injector, phase, steps=steps))
        if problems:
            raise PreflightError(problems)
        return planned

    def apply(self, stack: contextlib.ExitStack, fault: PlannedFault,
              record: FaultRecord | None = None, step: str | None = None) -> FaultRecord:
        """Apply ``fault`` in the step ``step`` (default: its first), its revert on ``stack``;
        a flapping fault's later on-edges pass the ``record`` of its first, and each apply and
        revert adds an edge to it."""
        spec = fault.spec
        if record is None:
            record = FaultRecord(name=spec.label, type=spec.type,
                                 phase=step or fault.phase, configured=fault.describe(),
                                 owner=self.owner,
                                 at=spec.at or "local", settings=settings_text(spec))
            self.records.append(record)
        edge = FlapEdge(time.time(), "on") if spec.flap is not None else None
        if self.lease is not None:
            try:
                self.lease.check(self._held)     # never a fault on a lapsed lease
            except LeaseLapsed as exc:
                record.error = f"not applied: {exc}"
                raise
        # Shielded: a SIGINT/SIGTERM between the journal's entry and its revert on the stack
        # left the entry with nothing to revert it (a double SIGTERM at a step edge: exit 143,
        # the next run refused until `recover`); held, it is raised once the revert is there.
        with self.signals.shield():
            entry = self.journal.add(fault.journal_type or record.type, record.name)
            killpoint("fault.journalled")
            self._held.add(entry.entry_id)
            stack.callback(self._revert, record, fault.injector, entry)
        if edge is not None:
            record.edges.append(edge)
        started = time.perf_counter()
        try:
            record.applied = fault.injector.apply(entry)
        except InjectorError as exc:
            # A stop (SIGSTOP, a starved machine) between the lease check and the change: the
            # watchdog undid the run meanwhile, which is why the apply failed ("removed by
            # another process", a device gone). The lease is checked again: that is exit 5.
            lapsed = self.lease.lapsed(self._held) if self.lease is not None else None
            record.error = f"not applied: {lapsed}" if lapsed else f"apply failed: {exc}"
            if edge is not None:
                edge.error = record.error
            if lapsed:
                raise LeaseLapsed(lapsed) from exc
            raise
        record.apply_ms = (time.perf_counter() - started) * 1000
        if edge is not None:
            edge.took_ms = record.apply_ms
        if edge is None or record.applied_at is None:   # a flapping fault's: its first on-edge
            record.applied_at = time.time()
        record.configured = fault.describe()   # complete now (netem: the table that was sent)
        self.events.emit(FaultApplied(record))
        return record

    def _revert(self, record: FaultRecord, injector: Injector, entry: JournalEntry) -> None:
        with self.signals.shield():
            self._revert_shielded(record, injector, entry)

    def _revert_shielded(self, record: FaultRecord, injector: Injector,
                         entry: JournalEntry) -> None:
        self._held.discard(entry.entry_id)
        if record.applied_at is not None and not entry.present():
            # Taken away mid-phase: the phase was not faulted throughout, and saying "reverted"
            # would be a lie. By this run's own watchdog if its lease lapsed (the run was
            # stopped), else by another process (a second run, `streamquake recover`).
            lapsed = self.lease.lapsed() if self.lease is not None else None
            by = ("undone by the watchdog when this run's lease lapsed" if lapsed else
                  "removed under this run by another process (its journal entry vanished)")
            record.error = f"{by} before the phase ended; the phase was not faulted throughout"
            self.errors.append(f"fault '{record.name}': {record.error}")
        edge = FlapEdge(time.time(), "off") if record.edges else None
        if edge is not None:
            record.edges.append(edge)
        started = time.perf_counter()
        try:
            record.reverted = run_with_deadline(
                injector.revert, REVERT_TIMEOUT_S, f"reverting {record.name}"
            )
        except Exception as exc:  # noqa: BLE001 - a failed revert must never stop other reverts
            if edge is not None:
                edge.error = f"revert failed: {exc}"
            self.revert_failed = True
            record.error = (record.error + "; " if record.error else "") + f"revert failed: {exc}"
            self.errors.append(
                f"fault '{record.name}' may still be in place ({exc}); "
                "run `streamquake recover` to retry"
            )
            self.events.emit(FaultReverted(record))
            return
        record.reverted_at = time.time()
        if edge is not None:
            edge.took_ms = (time.perf_counter() - started) * 1000
        entry.done()
        self.events.emit(FaultReverted(record))
