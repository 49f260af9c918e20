"""Local runs watched under leases: the local agent is every run's watchdog.

A ``streamquake run`` applies its faults itself (phase edges need its clock), journaling each
before it changes anything; it also asks the local agent to watch it (``POST /v1/runs``) and
renews that lease from a thread while it lives. When renewals stop for a whole lease (the run
was SIGKILLed, SIGSTOPped, or starved that long), the agent undoes every journal entry the run
owns, exactly as ``streamquake recover`` would, without anyone having to type it. So a fault
in a run and a fault from ``inject`` are held the same way: by a lease the agent enforces.

Only an agent started with ``--watch-runs JOURNAL`` watches runs, and only runs of that journal:
a request cannot point it at other files.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.agentwire.api import EndedBy, RunState, WatchedRun, WatchRun
from streamquake.journal import Journal

ENDED_KEPT = 64
Log = Callable[[str], None]


class RunWatchError(Exception):
    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


@dataclass
class LocalRun:
    id: str
    pid: int
    pid_start: int | None
    label: str
    lease_s: float
    expires_mono: float
    renewals: int = 0
    state: RunState = "watched"
    ended_by: EndedBy | None = None
    recovered: list[str] = field(default_factory=list)

    def view(self) -> WatchedRun:
        remaining = max(0.0, self.expires_mono - time.monotonic()) if self.state == "watched" \
            else 0.0
        return WatchedRun(id=self.id, pid=self.pid, label=self.label, state=self.state,
                          lease_s=self.lease_s, expires_at=time.time() + remaining,
                          remaining_s=round(remaining, 3), renewals=self.renewals,
                          ended_by=self.ended_by, recovered=self.recovered)


class RunWatch:
    """The runs one agent watches. Call from the event loop's thread; ``lapse`` runs the
    (blocking) recovery, so the holder calls it in its thread pool."""

    def __init__(self, journal_path: Path | None, log: Log) -> None:
        self.journal_path = journal_path
        self.log = log
        self._runs: dict[str, LocalRun] = {}
        self._ended: OrderedDict[str, LocalRun] = OrderedDict()

    def watching(self) -> bool:
        return any(r.state != "ended" for r in self._runs.values())

    def watch(self, req: WatchRun) -> WatchedRun:
        if self.journal_path is None:
            raise RunWatchError(404, "this agent does not watch runs (it was started without "
                                "--watch-runs); the local agent that `run` starts does")
        if Path(req.journal).resolve() != self.journal_path.resolve():
            raise RunWatchError(403, f"this agent watches runs of the journal "
                                f"{self.journal_path}, not {req.journal}")
        run = LocalRun(id=uuid.uuid4().hex[:16], pid=req.pid, pid_start=req.pid_start,
                   label=req.label or f"pid {req.pid}", lease_s=req.lease_s,
                   expires_mono=time.monotonic() + req.lease_s)
        self._runs[run.id] = run
        self.log(f"watching run {run.label} (pid {run.pid}, id {run.id}) under a "
                 f"{run.lease_s:g} s lease")
        return run.view()

    def _find(self, key: str) -> LocalRun:
        run = self._runs.get(key)
        if run is not None:
            return run
        ended = self._ended.get(key)
        if ended is not None:
            raise RunWatchError(410, f"run {ended.label} is no longer watched: "
                                f"{ended.ended_by}; " + ("; ".join(ended.recovered)
                                                         or "it owned nothing to undo"))
        raise RunWatchError(404, f"no run with the id {key!r} is watched by this agent")

    def renew(self, key: str, lease_s: float | None) -> WatchedRun:
        run = self._find(key)
        if run.state != "watched":
            raise RunWatchError(410, f"run {run.label}'s lease lapsed and its faults are being "
                                "undone")
        if lease_s is not None:
            run.lease_s = lease_s
        run.expires_mono = time.monotonic() + run.lease_s
        run.renewals += 1
        return run.view()

    def end(self, key: str) -> WatchedRun:
        run = self._find(key)
        if run.state == "watched":
            self._finish(run, "request")
            self.log(f"run {run.label} ended; no longer watched")
        return run.view()

    def lapsed(self) -> list[LocalRun]:
        """Runs whose lease ran out now; each is marked reverting (returned once)."""
        now = time.monotonic()
        out = []
        for run in self._runs.values():
            if run.state == "watched" and run.expires_mono <= now:
                run.state = "reverting"
                run.ended_by = "lease expiry"
                self.log(f"lease of run {run.label} (pid {run.pid}) lapsed "
                         f"{(now - run.expires_mono) * 1000:.0f} ms ago without a renewal: "
                         "undoing every fault it journaled")
                out.append(run)
        return out

    def next_end(self) -> float | None:
        ends = [r.expires_mono for r in self._runs.values() if r.state == "watched"]
        return min(ends) if ends else None

    def undo(self, run: LocalRun) -> tuple[list[str], bool]:
        """Blocking, for a worker thread: revert what the run owns in the journal (alive or
        not). Touches only the journal; ``undone`` records the answer on the loop's thread."""
        from streamquake.faults.recovery import recover_owner

        assert self.journal_path is not None
        return recover_owner(Journal(self.journal_path), run.pid, run.pid_start)

    def undone(self, run: LocalRun, lines: list[str], failed: bool) -> None:
        run.recovered = lines or ["it owned nothing to undo"]
        for line in run.recovered:
            self.log(f"run {run.label}: {line}")
        if failed:
            self.log(f"WARNING: some faults of run {run.label} could not be undone; they stay "
                     "in the journal for `streamquake recover`")
        self._finish(run, "lease expiry")

    def _finish(self, run: LocalRun, by: EndedBy) -> None:
        run.state = "ended"
        run.ended_by = by
        self._runs.pop(run.id, None)
        self._ended[run.id] = run
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
