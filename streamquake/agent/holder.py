"""Faults held under leases: applied through the fault contract, kept while renewed, reverted on
request, on shutdown, or by the watchdog when a lease lapses.

The journal (``streamquake.journal``, in the agent's own state directory) is written before a
fault changes anything, exactly as a run does, so a SIGKILLed agent leaves enough behind for its
next incarnation to undo on start (``recover_at_start``). Each fault keeps the owner key it was
applied with (in memory only: a restarted agent holds nothing); only that key renews or reverts
it, short of a forced revert, which is logged loudly. Everything blocking (the injectors, the
journal's file lock) runs in a thread pool; the event loop only keeps time and answers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import JsonValue, ValidationError

from streamquake.agent.policy import Allowlist
from streamquake.agent.runs import LocalRun, RunWatch
from streamquake.agentwire.api import (
    ApplyRequest,
    EndedBy,
    FaultState,
    HeldFault,
    Reverted,
    RevertedAll,
)
from streamquake.errors import StreamquakeError, validation_sentences
from streamquake.faults.catalog import fault_types, standing_for, standings
from streamquake.faults.contract import (
    EndsByItself,
    FaultSpec,
    HoldRequest,
    Injector,
    Preflights,
    RunContext,
)
from streamquake.faults.written import as_written
from streamquake.journal import Journal, JournalEntry
from streamquake.jsontypes import JsonDict
from streamquake.scenario.network import NetworkConfig
from streamquake.units import format_clock

APPLY_TIMEOUT_S = 30.0
REVERT_TIMEOUT_S = 30.0
PREFLIGHT_TIMEOUT_S = 15.0
WATCH_INTERVAL_S = 0.1        # the watchdog's tick; it also wakes at each lease's end
RETRY_REVERT_S = 5.0
# How often a held fault that can end by itself is asked whether it did (EndsByItself).
ENDED_CHECK_S = 2.0
ENDED_CHECK_TIMEOUT_S = 5.0
ENDED_KEPT = 256              # ended faults remembered, so a late renew hears why (410)

T = TypeVar("T")
Log = Callable[[str], None]


class AgentError(Exception):
    """An answer other than success: an HTTP status and a sentence."""

    def __init__(self, status: int, error: str, problems: list[str] | None = None,
                 ended: Reverted | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.problems = problems or []
        self.ended = ended


@dataclass
class _Held:
    id: str
    name: str
    type: str
    owner: str
    owner_key: str = field(repr=False)
    spec: FaultSpec
    injector: Injector
    entry: JournalEntry
    lease_s: float
    applied_at: float
    expires_mono: float
    applied: JsonDict
    renewals: int = 0
    state: FaultState = "held"
    error: str | None = None
    ended_by: EndedBy = "request"
    reverting: asyncio.Task[Reverted] | None = None
    inflight: asyncio.Future[JsonDict] | None = None
    retry_mono: float = 0.0

    @property
    def expires_at(self) -> float:
        return time.time() + (self.expires_mono - time.monotonic())


class Holder:
    """The faults one agent holds. Call only from the event loop's thread."""

    def __init__(self, journal: Journal, allow: Allowlist, state_dir: Path, log: Log,
                 idle_exit_s: float | None = None, runs_journal: Path | None = None) -> None:
        self.journal = journal
        self.runs = RunWatch(runs_journal, log)
        self.allow = allow
        self.state_dir = state_dir
        self.log = log
        self.idle_exit_s = idle_exit_s
        self.host = socket.gethostname()
        self.recovered: list[str] = []
        self.last_activity = time.monotonic()
        self._held: dict[str, _Held] = {}
        self._names: set[str] = set()        # held, or being applied right now
        self._ended: OrderedDict[str, Reverted] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="sq-agent")
        self._asking: set[str] = set()       # held faults being asked whether they ended
        self._next_ask = 0.0

    # -- start and stop ----------------------------------------------------------------------

    def recover_at_start(self) -> list[str]:
        """Undo what this agent's previous incarnation left (its journal's orphans)."""
        from streamquake.faults.recovery import recover_all

        orphans = self.journal.orphans()
        if not orphans and not self.journal.damaged:
            self.log(f"journal {self.journal.path}: nothing left by a previous agent")
            return []
        lines, failed = recover_all(self.journal)
        for line in lines:
            self.log(f"recovery at start: {line}")
        if failed:
            self.log("WARNING: some faults left by the previous agent could not be undone; "
                     "they are listed above and stay in the journal")
        self.recovered = lines
        return lines

    async def shutdown(self) -> RevertedAll:
        answer = await self._revert_each(list(self._held.values()), "shutdown")
        self._pool.shutdown(wait=False, cancel_futures=True)
        return answer

    def idle(self) -> bool:
        return (self.idle_exit_s is not None and not self._names and not self.runs.watching()
                and time.monotonic() - self.last_activity >= self.idle_exit_s)

    # -- the watchdog ------------------------------------------------------------------------

    async def watch(self, stop: asyncio.Event) -> None:
        """Revert lapsed leases (checked every WATCH_INTERVAL_S), retry failed reverts."""
        while not stop.is_set():
            now = time.monotonic()
            for held in list(self._held.values()):
                if held.state == "held" and held.expires_mono <= now:
                    late_ms = (now - held.expires_mono) * 1000
                    self.log(f"lease of {held.name} ({held.type}, owner {held.owner or '-'}) "
                             f"lapsed {late_ms:.0f} ms ago without a renewal: reverting it")
                    self._background(self._revert_quietly(held, "lease expiry"))
                elif (held.state == "revert failed" and now >= held.retry_mono
                      and (held.inflight is None or held.inflight.done())):
                    self.log(f"retrying the revert of {held.name}")
                    self._background(self._revert_quietly(held, held.ended_by))
            for run in self.runs.lapsed():
                self._background(self._undo_run(run))
            if now >= self._next_ask:
                self._next_ask = now + ENDED_CHECK_S
                for held in list(self._held.values()):
                    if (held.state == "held" and isinstance(held.injector, EndsByItself)
                            and held.id not in self._asking):
                        self._asking.add(held.id)
                        self._background(self._ask_ended(held))
            if self.idle():
                self.log(f"idle for {self.idle_exit_s:g} s with no fault held: exiting")
                stop.set()
                return
            # Wake at the next lease's end if that comes sooner than the next tick.
            ends = [h.expires_mono for h in self._held.values() if h.state == "held"]
            if (run_end := self.runs.next_end()) is not None:
                ends.append(run_end)
            wait_s = min([WATCH_INTERVAL_S, *(e - time.monotonic() for e in ends)])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.001, wait_s))

    async def _undo_run(self, run: LocalRun) -> None:
        try:
            lines, failed = await self._call(lambda: self.runs.undo(run), 2 * REVERT_TIMEOUT_S,
                                             f"undoing run {run.label}'s faults")
        except Exception as exc:  # noqa: BLE001 - said; the journal keeps them for `recover`
            lines, failed = [f"FAILED: {exc}"], True
        self.runs.undone(run, lines, failed)
        self.touch()

    async def _ask_ended(self, held: _Held) -> None:
        """End the hold of a fault whose part went away (its revert then says so)."""
        assert isinstance(held.injector, EndsByItself)
        try:
            why = await self._call(held.injector.ended, ENDED_CHECK_TIMEOUT_S,
                                   f"asking whether {held.name} still stands")
        except Exception:  # noqa: BLE001 - nothing could tell: it stays held, asked again
            why = None
        finally:
            self._asking.discard(held.id)
        if why is not None and held.state == "held":
            self.log(f"{held.name} ({held.type}, id {held.id}) ended by itself: {why}")
            await self._revert_quietly(held, "ended by itself")

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what the API calls ------------------------------------------------------------------

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def view(self, held: _Held) -> HeldFault:
        remaining = max(0.0, held.expires_mono - time.monotonic())
        spec: dict[str, JsonValue] = as_written(held.spec)
        return HeldFault(
            id=held.id, name=held.name, type=held.type, owner=held.owner, host=self.host,
            state=held.state, lease_s=held.lease_s, applied_at=held.applied_at,
            expires_at=time.time() + remaining, remaining_s=round(remaining, 3),
            renewals=held.renewals, spec=spec, applied=_json(held.applied), error=held.error,
        )

    def faults(self) -> list[HeldFault]:
        return [self.view(h) for h in sorted(self._held.values(), key=lambda h: h.applied_at)]

    def held_count(self) -> int:
        return len(self._held)

    def parse(self, req: ApplyRequest) -> tuple[FaultSpec, NetworkConfig | None]:
        """The request's fault and network, validated through the catalog's own spec models."""
        raw = {k: v for k, v in req.fault.items() if k != "at"}
        type_name = raw.get("type")
        if not isinstance(type_name, str):
            raise AgentError(400, "the fault has no `type`: give one, e.g. {type: netem, ...}")
        refused = self.allow.type_refusal(type_name)
        if refused:
            raise AgentError(403, refused)
        known = fault_types().get(type_name)
        if known is None:
            raise AgentError(400, f"no fault family offers type {type_name!r} on this agent")
        try:
            spec = known.spec.model_validate(raw)
        except ValidationError as exc:
            problems = validation_sentences(exc, "fault")
            raise AgentError(400, "; ".join(problems), problems) from None
        network = None
        if req.network is not None:
            try:
                network = NetworkConfig.model_validate(req.network)
            except ValidationError as exc:
                problems = validation_sentences(exc, "network")
                raise AgentError(400, "; ".join(problems), problems) from None
        refused = self.allow.refusal(spec, HoldRequest(network, _standing_url(req, spec)))
        if refused:
            raise AgentError(403, refused)
        return spec, network

    def _injector(self, req: ApplyRequest, spec: FaultSpec,
                  network: NetworkConfig | None) -> Injector:
        standing = standing_for(spec.type)
        url = _standing_url(req, spec)
        ctx = RunContext(
            target_host=req.target.host if req.target else "",
            target_port=req.target.port if req.target else 0,
            run_dir=self.state_dir, network=network, journal=self.journal,
            resources=[standing.attach(url)] if standing and url else [],
        )
        try:
            return fault_types()[spec.type].injector()(spec, ctx)
        except (StreamquakeError, ValueError, ImportError) as exc:
            raise AgentError(422, f"cannot set up {spec.label} ({spec.type}) here: {exc}") from exc

    async def _call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, fn), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None

    async def preflight(self, req: ApplyRequest) -> list[str]:
        spec, network = self.parse(req)
        injector = self._injector(req, spec, network)
        if not isinstance(injector, Preflights):
            return []
        try:
            return await self._call(injector.preflight, PREFLIGHT_TIMEOUT_S,
                                    f"the preflight of {spec.label}")
        except TimeoutError as exc:
            return [str(exc)]

    async def apply(self, req: ApplyRequest, owner_key: str) -> HeldFault:
        spec, network = self.parse(req)
        name = spec.label
        fault_id = req.id or uuid.uuid4().hex[:12]
        if name in self._names:
            held = next((h for h in self._held.values() if h.name == name), None)
            whose = (f" (owner {held.owner or '-'}, {held.expires_mono - time.monotonic():.0f} "
                     "s left)") if held else " (being applied now)"
            raise AgentError(409, f"a fault named {name} is held here already{whose}: revert "
                             "it first, or give this one another `name`")
        if fault_id in self._held or fault_id in self._ended:
            raise AgentError(409, f"the fault id {fault_id} was used already: send a new one")
        injector = self._injector(req, spec, network)
        self._names.add(name)
        try:
            return await self._apply(req, spec, injector, fault_id, owner_key)
        except BaseException:
            if fault_id not in self._held:
                self._names.discard(name)
            raise

    async def _apply(self, req: ApplyRequest, spec: FaultSpec, injector: Injector,
                     fault_id: str, owner_key: str) -> HeldFault:
        name = spec.label
        if isinstance(injector, Preflights):
            try:
                problems = await self._call(injector.preflight, PREFLIGHT_TIMEOUT_S,
                                            f"the preflight of {name}")
            except TimeoutError as exc:
                problems = [str(exc)]
            if problems:
                raise AgentError(422, f"{name} ({spec.type}) cannot be applied here: "
                                 + "; ".join(problems), problems)
        # Each lease owns what its fault claims: a second lease on the same thing is refused.
        entry = await self._call(lambda: self.journal.add(spec.type, name, lease=fault_id),
                                 APPLY_TIMEOUT_S, "writing the journal")
        try:
            applied = await self._call(lambda: injector.apply(entry), APPLY_TIMEOUT_S,
                                       f"applying {name}")
        except BaseException as exc:
            undone = await self._undo_partial(name, injector, entry)
            if isinstance(exc, StreamquakeError | TimeoutError | OSError):
                raise AgentError(422, f"could not apply {name} ({spec.type}): {exc}; {undone}",
                                 ) from exc
            raise
        now = time.monotonic()
        held = _Held(id=fault_id, name=name, type=spec.type, owner=req.owner,
                     owner_key=owner_key, spec=spec, injector=injector, entry=entry,
                     lease_s=req.lease_s, applied_at=time.time(),
                     expires_mono=now + req.lease_s, applied=applied)
        self._held[fault_id] = held
        self.log(f"applied {name} ({spec.type}, id {fault_id}) for owner {req.owner or '-'}; "
                 f"lease {req.lease_s:g} s, until {format_clock(held.expires_at)} unless renewed")
        return self.view(held)

    async def _undo_partial(self, name: str, injector: Injector, entry: JournalEntry) -> str:
        try:
            await self._call(injector.revert, REVERT_TIMEOUT_S, f"reverting {name}")
        except Exception as exc:  # noqa: BLE001 - said, and the journal keeps it for recovery
            self.log(f"WARNING: {name} failed to apply and its partial revert failed too: {exc}")
            return (f"undoing the partial apply failed too ({exc}): it stays in the journal, "
                    "and this agent's next start retries it")
        await self._call(entry.done, REVERT_TIMEOUT_S, "writing the journal")
        return "the partial apply was undone"

    def _find(self, key: str) -> _Held:
        held = self._held.get(key) or next(
            (h for h in self._held.values() if h.name == key), None)
        if held is not None:
            return held
        ended = self._ended.get(key) or next(
            (e for e in reversed(self._ended.values()) if e.name == key), None)
        if ended is not None:
            raise AgentError(410, f"{ended.name} is no longer held: it was reverted at "
                             f"{format_clock(ended.reverted_at)} ({ended.by})", ended=ended)
        raise AgentError(404, f"no fault with the id or name {key!r} is held by this agent")

    def _owned(self, held: _Held, owner_key: str | None, what: str, force: bool = False) -> None:
        """Only the key a fault was applied with may renew or revert it; a forced revert is an
        operator's emergency, said loudly."""
        if owner_key is not None and hmac.compare_digest(owner_key.encode(),
                                                         held.owner_key.encode()):
            return
        if not force:
            raise AgentError(403, f"{held.name} belongs to another owner ({held.owner or '-'}): "
                             f"only the owner key it was applied with may {what} it; in an "
                             "emergency an operator can force a revert (`streamquake revert "
                             f"{held.name} --force`, or DELETE with ?force=true)")
        self.log(f"WARNING: FORCED {what} of {held.name} ({held.type}, id {held.id}, owner "
                 f"{held.owner or '-'}) by a caller without its owner key")

    def renew(self, key: str, lease_s: float | None, owner_key: str | None) -> HeldFault:
        held = self._find(key)
        self._owned(held, owner_key, "renew")
        if held.state != "held":
            raise AgentError(409, f"{held.name} is being reverted ({held.ended_by}) and cannot "
                             "be renewed: apply it again")
        if lease_s is not None:
            held.lease_s = lease_s
        held.expires_mono = time.monotonic() + held.lease_s
        held.renewals += 1
        return self.view(held)

    async def revert(self, key: str, owner_key: str | None, force: bool = False) -> Reverted:
        held = self._find(key)
        self._owned(held, owner_key, "revert", force)
        return await self._revert(held, "request")

    async def revert_all(self, owner_key: str | None, force: bool = False) -> RevertedAll:
        """What ``owner_key`` owns (``force``: everything held); the rest is ``skipped``."""
        mine, skipped = [], []
        for h in list(self._held.values()):
            try:
                self._owned(h, owner_key, "revert", force)
                mine.append(h)
            except AgentError:
                skipped.append(f"{h.name} (owner {h.owner or '-'})")
        answer = await self._revert_each(mine, "request")
        answer.skipped = skipped
        return answer

    async def _revert_each(self, held: list[_Held], by: EndedBy) -> RevertedAll:
        results = await asyncio.gather(*(self._revert(h, by) for h in held),
                                       return_exceptions=True)
        answer = RevertedAll(reverted=[], failed=[])
        for h, r in zip(held, results, strict=True):
            if isinstance(r, Reverted):
                answer.reverted.append(r)
            else:
                answer.failed.append(f"{h.name}: {getattr(r, 'error', r)}")
        return answer

    async def _revert_quietly(self, held: _Held, by: EndedBy) -> None:
        with contextlib.suppress(AgentError):   # said in the log; the watchdog retries
            await self._revert(held, by)

    def _revert(self, held: _Held, by: EndedBy) -> asyncio.Future[Reverted]:
        if held.reverting is None:
            held.state = "reverting"
            held.ended_by = by
            held.reverting = asyncio.get_running_loop().create_task(self._do_revert(held))
        return asyncio.shield(held.reverting)

    async def _do_revert(self, held: _Held) -> Reverted:
        loop = asyncio.get_running_loop()
        try:
            if held.inflight is None or held.inflight.done():
                held.inflight = loop.run_in_executor(self._pool, held.injector.revert)
            try:
                result = await asyncio.wait_for(asyncio.shield(held.inflight), REVERT_TIMEOUT_S)
            except TimeoutError:
                raise TimeoutError(f"reverting {held.name} did not finish within "
                                   f"{REVERT_TIMEOUT_S:g} s") from None
            await self._call(held.entry.done, REVERT_TIMEOUT_S, "writing the journal")
        except Exception as exc:  # noqa: BLE001 - the fault may still be in place: say so, retry
            held.state = "revert failed"
            held.error = str(exc)
            held.retry_mono = time.monotonic() + RETRY_REVERT_S
            held.reverting = None
            self.log(f"ERROR: could not revert {held.name} ({held.type}): {exc}; retrying "
                     f"every {RETRY_REVERT_S:g} s")
            raise AgentError(500, f"could not revert {held.name} ({held.type}): {exc}; the "
                             f"agent retries every {RETRY_REVERT_S:g} s") from exc
        ended = Reverted(id=held.id, name=held.name, type=held.type, owner=held.owner,
                         host=self.host, by=held.ended_by, applied_at=held.applied_at,
                         reverted_at=time.time(), reverted=_json(result))
        self._held.pop(held.id, None)
        self._names.discard(held.name)
        self._ended[held.id] = ended
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        self.touch()
        self.log(f"reverted {held.name} ({held.type}, id {held.id}) [{held.ended_by}]: "
                 f"{result}")
        return ended


def _standing_url(req: ApplyRequest, spec: FaultSpec) -> str | None:
    """The control URL of the standing resource (a standing SSE proxy) the request names
    (``proxy``), if any."""
    if req.proxy is None:
        return None
    standing = standing_for(spec.type)
    if standing is None:
        what = " or ".join(f"a {s.what}, for {', '.join(sorted(s.types))} faults"
                           for s in standings()) or "a standing resource"
        raise AgentError(400, f"`proxy` names {what}; {spec.label} is a {spec.type} fault: "
                         "leave it out")
    try:
        return standing.control_url(req.proxy)
    except ValueError as exc:
        raise AgentError(400, f"proxy: {exc}") from None


def _json(d: JsonDict) -> dict[str, JsonValue]:
    # The contract's JSON type and pydantic's are the same values under two names.
    return d
