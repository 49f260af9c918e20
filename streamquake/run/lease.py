"""The run's lease with its watchdog, the local agent (``streamquake/agent/runs.py``).

The run still applies and reverts its own faults at its phase edges, journaling each first; the
lease is what makes the journal act on its own. A thread asks the local agent (started, detached,
if none runs) to watch this process, then renews every ``lease / 5``. If the run is SIGKILLed,
SIGSTOPped or starved for a whole lease, renewals stop and the agent undoes every entry this
process owns in the journal: nobody has to remember ``streamquake recover``. If the agent cannot
be reached, the run goes on with the journal alone and says so once.

Should the run wake after its lease lapsed (SIGCONT after a stop), its faults are already gone.
``check`` (before every change the run makes) and ``lapsed`` (at every tick, and when a fault is
found gone) tell it so at once, without waiting for the next renewal to hear 410: a renewal last
sent a whole lease ago means the agent has given up on us, whether it has said so yet or not.
The runner then applies nothing more, aborts, and exits 5.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Collection

from streamquake.agentwire.api import WatchRun
from streamquake.agentwire.client import AgentClient, AgentRefused
from streamquake.errors import LeaseLapsed, StreamquakeError
from streamquake.journal import Journal, pid_start_time

READY_TIMEOUT_S = 25.0        # the local agent's start (START_TIMEOUT_S) and a margin
RENEW_DIVISOR = 5             # renew every lease / 5: four renewals may fail before a lapse


class RunLease:
    def __init__(self, journal: Journal, lease_s: float, label: str) -> None:
        self.journal = journal
        self.lease_s = lease_s
        self.label = label
        self.lost: str | None = None          # why the agent stopped watching us, if it did
        self.unwatched: str | None = None     # why no watchdog holds this run, if none does
        self._client: AgentClient | None = None
        self._id: str | None = None
        self._renewed: float | None = None    # monotonic send time of the last accepted renewal
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="sq-run-lease", daemon=True)

    def __enter__(self) -> RunLease:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def watched(self) -> bool:
        return self._id is not None and self.lost is None

    def wait_ready(self) -> str | None:
        """Block until the agent watches us (or could not); a warning sentence if it does not."""
        if not self._ready.wait(READY_TIMEOUT_S):
            self.unwatched = f"the local agent did not answer within {READY_TIMEOUT_S:g} s"
        if self.unwatched is None:
            return None
        return (f"no watchdog holds this run's faults ({self.unwatched}): if this process is "
                "killed, they stay until `streamquake recover`")

    def lapsed(self, held: Collection[str] = ()) -> str | None:
        """Why this run's lease no longer holds, or None while it does (or no watchdog holds
        the run at all). ``held``: journal entry ids the run still holds; one gone from the
        journal means the watchdog has already undone them."""
        if self.lost is not None:
            why = self.lost
        elif self._renewed is not None and (
                since := time.monotonic() - self._renewed) >= self.lease_s:
            why = f"no renewal got through for {since:.1f} s"
        elif held and not set(held) <= {r.id for r in self.journal.records()}:
            why = "the watchdog took this run's entries from the journal"
        else:
            return None
        return (f"{why}: this run's {self.lease_s:g} s lease lapsed, and the watchdog undoes its "
                "faults (was this process stopped?)")

    def check(self, held: Collection[str] = ()) -> None:
        """Raise LeaseLapsed unless the lease holds: before every change to the system."""
        if (why := self.lapsed(held)) is not None:
            raise LeaseLapsed(why)

    def close(self) -> None:
        """The run has reverted its faults: stop renewing and end the watch."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self._client is not None and self._id is not None and self.lost is None:
            # On failure the lease lapses on its own; the journal holds nothing of ours now.
            with contextlib.suppress(StreamquakeError):
                self._client.end_run(self._id)

    def _hold(self) -> None:
        try:
            self._register()
        except StreamquakeError as exc:
            self.unwatched = str(exc)
        finally:
            self._ready.set()
        if self._id is None:
            return
        period = self.lease_s / RENEW_DIVISOR
        while not self._stop.wait(period):
            assert self._client is not None
            sent = time.monotonic()   # the agent's new term starts no earlier than this
            try:
                self._client.renew_run(self._id, read_timeout_s=period)
                self._renewed = sent
            except AgentRefused as exc:
                self.lost = (f"the local watchdog stopped holding this run ({exc.problem.error})"
                             if exc.status == 410 else f"the local watchdog refused a renewal "
                             f"({exc.problem.error})")
                return
            except StreamquakeError:
                continue    # a slow or restarting agent: the next renewal may get through

    def _register(self) -> None:
        from streamquake.agent.local import ensure_local_agent

        agent = ensure_local_agent()
        self._client = agent.client()
        pid = os.getpid()
        sent = time.monotonic()
        watched = self._client.watch_run(WatchRun(
            pid=pid, pid_start=pid_start_time(pid), journal=str(self.journal.path),
            label=self.label, lease=self.lease_s))
        self._id = watched.id
        self._renewed = sent
