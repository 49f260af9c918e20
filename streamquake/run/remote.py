"""Faults held by an agent on another host (``at: NAME`` in a scenario).

``RemoteInjector`` keeps the injector contract, so the ledger treats it like any other: ``apply``
asks the agent to hold the fault under a lease (the agent's ``lease``, default 15 s) and starts a
thread that renews it every lease/3; ``revert`` stops renewing and asks the agent to revert. If
the controller dies, or the network between them breaks, renewals stop and the agent reverts on
its own when the lease lapses. If the agent is unreachable at revert time, the record says so,
and that the lease does the revert.

The controller journals each remote fault as an ``agent_lease`` entry (the agent, the fault's id
there, the lease's end), so ``streamquake recover`` after a killed run asks that agent to revert
it, or confirms that its lease has ended (``recover_lease``). ``AgentDirectory`` is the run-long
resource that knows the scenario's agents, checks each once (reachable, token accepted, API
version) and lands in the report under ``telemetry.agents``.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Literal

from streamquake.agentwire.api import API_VERSION, AgentInfo, ApplyRequest, TargetAddr
from streamquake.agentwire.client import (
    APPLY_READ_TIMEOUT_S,
    AgentClient,
    AgentRefused,
    AgentUnreachable,
    agent_client,
)
from streamquake.agentwire.ref import AgentRef
from streamquake.errors import InjectorError, PreflightError, RevertError
from streamquake.faults.contract import FaultSpec, RunContext, Wiring
from streamquake.journal import JournalEntry
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.loopback import is_loopback
from streamquake.scenario.network import NetworkConfig
from streamquake.units import format_clock

REVERT_READ_TIMEOUT_S = 40.0     # the agent's own revert deadline is 30 s
_MAX_RENEW_ERRORS_KEPT = 5


class AgentDirectory:
    """The scenario's agents, for the run: clients, one check each, and the report."""

    key = "agents"
    title = "the fault agents"
    stage: Literal["before_target", "after_target"] = "after_target"

    def __init__(self, agents: Sequence[AgentRef]) -> None:
        self.agents = {a.name: a for a in agents}
        self.infos: dict[str, AgentInfo] = {}
        self._checked: dict[str, list[str]] = {}
        self.applied: dict[str, list[str]] = {}

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        """Nothing to start: agents are checked in the faults' preflight, all at once."""

    def stop(self) -> None:
        """Nothing to stop: each fault's revert ends its own lease."""

    def report(self) -> JsonDict | None:
        out: JsonDict = {}
        for name, ref in self.agents.items():
            info = self.infos.get(name)
            entry: JsonDict = {"url": ref.url, "lease_s": ref.lease_s,
                               "faults": list[JsonValue](self.applied.get(name, []))}
            if info is not None:
                entry.update({"host": info.host, "version": info.version, "api": info.api,
                              "allowed_types": list[JsonValue](info.allow.types)})
            problems = self._checked.get(name)
            if problems:
                entry["problems"] = list[JsonValue](problems)
            out[name] = entry
        return out or None

    def client(self, name: str, **timeouts: float) -> AgentClient:
        return agent_client(self.agents[name], **timeouts)

    def check(self, name: str) -> tuple[list[str], bool]:
        """(problems, first time asked): reachable, token accepted, same API version."""
        if name in self._checked:
            return self._checked[name], False
        ref = self.agents[name]
        problems = []
        host = urllib.parse.urlsplit(ref.url).hostname or ""
        if not os.environ.get(ref.token_env) and not is_loopback(host):
            problems.append(f"agent {name} ({ref.url}): ${ref.token_env} is not set; export "
                            "the agent's token before the run")
        else:
            try:
                info = self.client(name).info()
            except AgentRefused as exc:
                hint = (f"; check ${ref.token_env}" if exc.status == 401 else "")
                problems.append(f"{exc}{hint}")
            except InjectorError as exc:
                problems.append(str(exc))
            else:
                self.infos[name] = info
                if info.api != API_VERSION:
                    problems.append(
                        f"agent {name} ({ref.url}) speaks API v{info.api} (streamquake "
                        f"{info.version}) and this streamquake v{API_VERSION}: run the same "
                        "version on both sides")
        self._checked[name] = problems
        return problems, True


def remote_injector(spec: FaultSpec, ctx: RunContext, owner: str) -> RemoteInjector:
    directory = ctx.find(AgentDirectory)
    if directory is None or spec.at not in directory.agents:
        raise PreflightError(f"fault '{spec.label}' runs at '{spec.at}', but the scenario "
                             "lists no agent of that name under `agents`")
    return RemoteInjector(spec, ctx, directory, owner)


class RemoteInjector:
    """Forwards apply and revert to an agent and renews the lease between them."""

    def __init__(self, spec: FaultSpec, ctx: RunContext, directory: AgentDirectory,
                 owner: str) -> None:
        assert spec.at is not None
        self.spec = spec
        self.ctx = ctx
        self.directory = directory
        self.name = spec.at
        self.ref = directory.agents[spec.at]
        self.owner = owner
        self.id = uuid.uuid4().hex[:16]
        self.renewals = 0
        self.renew_errors: list[str] = []
        self.lost: str | None = None
        self._asked = False
        self._expires_at: float | None = None
        self._host: str | None = None
        self._entry: JournalEntry | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def request(self) -> ApplyRequest:
        from streamquake.faults.written import as_written

        fault = as_written(self.spec)
        fault.pop("at", None)
        net = self.ctx.network
        return ApplyRequest(
            fault=fault, lease=self.ref.lease_s, owner=self.owner, id=self.id,
            target=(TargetAddr(host=self.ctx.target_host, port=self.ctx.target_port)
                    if self.ctx.target_host else None),
            network=(NetworkConfig.model_validate(net, from_attributes=True).model_dump(
                mode="json", exclude_none=True) if net is not None and net.mode == "host"
                else None),
        )

    # -- the contract --------------------------------------------------------------------------

    def preflight(self) -> list[str]:
        problems, first = self.directory.check(self.name)
        if problems:
            return problems if first else []
        info = self.directory.infos[self.name]
        where = f"agent {self.name} (host {info.host})"
        if self.spec.type not in info.allow.types:
            return [f"{where} does not allow {self.spec.type} faults; it allows: "
                    f"{', '.join(info.allow.types) or 'none'}"]
        if self.spec.type in info.unavailable:
            return [f"{where}: {info.unavailable[self.spec.type]}"]
        try:
            remote = self.directory.client(self.name).preflight(self.request())
        except AgentRefused as exc:
            return [f"{where}: {p}" for p in exc.problem.problems] or [
                f"{where} refused it: {exc.problem.error}"]
        except InjectorError as exc:
            return [str(exc)]
        return [f"{where}: {p}" for p in remote]

    def apply(self, entry: JournalEntry) -> JsonDict:
        # Journal first: if we die while the agent applies it, recover knows whom to ask, and
        # when the lease ends at the latest.
        entry.save({"agent": self.name, "url": self.ref.url, "token_env": self.ref.token_env,
                    "ca_cert": self.ref.ca_cert, "client_cert": self.ref.client_cert,
                    "client_key": self.ref.client_key, "fault_id": self.id,
                    "name": self.spec.label, "lease_s": self.ref.lease_s,
                    "expires_at": time.time() + APPLY_READ_TIMEOUT_S + self.ref.lease_s})
        self._entry = entry
        self._asked = True
        held = self.directory.client(self.name).apply(self.request())
        self._expires_at, self._host = held.expires_at, held.host
        entry.save({"expires_at": held.expires_at, "host": held.host})
        self.directory.applied.setdefault(self.name, []).append(self.spec.label)
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"streamquake renew {self.spec.label}")
        self._thread.start()
        return {"at": self.name, "host": held.host, "agent_url": self.ref.url,
                "fault_id": held.id, "lease_s": held.lease_s, "expires_at": held.expires_at,
                "read_back": dict(held.applied)}

    def revert(self) -> JsonDict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        base: JsonDict = {"at": self.name, "host": self._host, "renewals": self.renewals}
        if self.renew_errors:
            base["renew_errors"] = list[JsonValue](self.renew_errors)
        if not self._asked:
            return {**base, "reverted": "nothing: it was never sent to the agent"}
        client = self.directory.client(self.name, read_timeout_s=REVERT_READ_TIMEOUT_S)
        try:
            done = client.revert(self.id)
        except AgentRefused as exc:
            return {**base, **self._refused(exc)}
        except AgentUnreachable as exc:
            return {**base, **self._unreachable(exc)}
        return {**base, "host": done.host, "by": done.by, "reverted_at": done.reverted_at,
                "reverted": dict(done.reverted)}

    # -- the lease -----------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        period = self.ref.lease_s / 3
        client = self.directory.client(self.name, connect_timeout_s=min(3.0, period),
                                       read_timeout_s=max(1.0, period))
        while not self._stop.wait(period):
            try:
                held = client.renew(self.id)
            except AgentRefused as exc:
                if exc.status in (404, 410):
                    self._lose(exc)
                    return
                self._renew_failed(exc)
            except InjectorError as exc:
                self._renew_failed(exc)
            else:
                self.renewals += 1
                self._expires_at = held.expires_at
                if self._entry is not None:
                    try:
                        self._entry.save({"expires_at": held.expires_at})
                    except InjectorError:
                        return      # the entry is gone: the ledger reports that at revert

    def _renew_failed(self, exc: InjectorError) -> None:
        if len(self.renew_errors) < _MAX_RENEW_ERRORS_KEPT:
            self.renew_errors.append(f"{format_clock(time.time())}: {exc}")

    def _lose(self, exc: AgentRefused) -> None:
        """The agent no longer holds it (its lease lapsed, or it restarted): the phase is not
        faulted any more. Dropping the journal entry makes the ledger report exactly that."""
        self.lost = f"{format_clock(time.time())}: {exc.problem.error}"
        if self._entry is not None:
            self._entry.done()

    def _refused(self, exc: AgentRefused) -> JsonDict:
        ended = exc.problem.ended
        if exc.status == 410 and ended is not None:
            return {"by": ended.by, "reverted_at": ended.reverted_at,
                    "reverted": dict(ended.reverted), "lost": self.lost}
        if exc.status == 404:
            return {"reverted": "nothing: the agent does not hold it (it refused or never "
                    "received the apply)", "lost": self.lost}
        raise RevertError(f"{exc}; the agent retries on its own, and `streamquake status --at "
                          f"{self.ref.url}` shows it") from exc

    def _unreachable(self, exc: AgentUnreachable) -> JsonDict:
        ends = self._expires_at
        when = f"at {format_clock(ends)}" if ends is not None else "when its lease lapses"
        return {"by": "lease expiry", "agent_unreachable": str(exc), "lease_ends_at": ends,
                "note": f"the agent could not be asked to revert; it reverts on its own {when}"}
