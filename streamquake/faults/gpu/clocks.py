"""GPU faults through NVML: lock SM / memory clocks to a window, cap the power limit.

The original settings of every GPU are journaled before anything changes; revert resets the
locks and puts back the exact original power limit. NVML cannot read back a lock's range, so a
lock that was already in place before the run is noted (``clocks_locked_before``, inferred from
the ``applications_clocks_setting`` clock-event reason) but cannot be re-created on revert.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from streamquake.errors import InjectorError, RevertError
from streamquake.faults.contract import RunContext
from streamquake.faults.gpu.nvml import (
    ARCH_AMPERE,
    ARCH_VOLTA,
    Gpu,
    Handle,
    Nvml,
    NvmlError,
    Operation,
    decode_reasons,
    explain,
    gpu_by_uuid,
    not_supported_message,
    nvml_session,
    or_none,
    out_of_range_message,
    power_limit_range_w,
    select_gpus,
    supported_mem_clocks,
    supported_sm_range,
)
from streamquake.faults.gpu.spec import GpuClocksFault
from streamquake.journal import JournalEntry
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.killpoints import killpoint

_NOT_SUPPORTED = 3
_Op = Literal["sm_clocks", "mem_clocks", "power_limit"]
_APPLY_OP: dict[str, Operation] = {
    "sm_clocks": "lock_sm_clocks",
    "mem_clocks": "lock_mem_clocks",
    "power_limit": "set_power_limit",
}
_UNDO_OP: dict[str, Operation] = {
    "sm_clocks": "reset_sm_clocks",
    "mem_clocks": "reset_mem_clocks",
    "power_limit": "set_power_limit",
}
_SETTING = {"sm_clocks": "SM clock lock", "mem_clocks": "memory clock lock",
            "power_limit": "power limit"}


@dataclass(frozen=True)
class _Plan:
    """The fault resolved for one GPU: percentages turned into MHz and milliwatts."""

    sm_mhz: tuple[int, int] | None
    mem_mhz: tuple[int, int] | None
    power_mw: int | None

    def ops(self) -> list[_Op]:
        todo: list[_Op] = []
        if self.sm_mhz:
            todo.append("sm_clocks")
        if self.mem_mhz:
            todo.append("mem_clocks")
        if self.power_mw is not None:
            todo.append("power_limit")
        return todo

    def requested(self, op: str) -> str:
        rng = self.sm_mhz if op == "sm_clocks" else self.mem_mhz if op == "mem_clocks" else None
        if rng:
            return f"{rng[0]} MHz" if rng[0] == rng[1] else f"{rng[0]}-{rng[1]} MHz"
        return f"{(self.power_mw or 0) / 1000:g} W"

    def to_json(self) -> JsonDict:
        return {
            "sm_clocks_mhz": [*self.sm_mhz] if self.sm_mhz else None,
            "mem_clocks_mhz": [*self.mem_mhz] if self.mem_mhz else None,
            "power_limit_w": self.power_mw / 1000 if self.power_mw is not None else None,
        }


@dataclass
class _GpuRecord:
    """One GPU as the journal keeps it: what revert and recover need (the settings ``changed``,
    oldest first, and the original ``power_limit_mw``) and, for people, what was read before
    anything changed (``before``: the read-back, the plan, ``clocks_locked_before``)."""

    uuid: str
    index: int | None
    before: JsonDict = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    power_limit_mw: int | None = None

    def to_json(self) -> JsonDict:
        out: JsonDict = {**self.before, "uuid": self.uuid, "index": self.index,
                         "changed": [*self.changed]}
        if self.power_limit_mw is not None:
            out["power_limit_mw"] = self.power_limit_mw
        return out

    @classmethod
    def from_json(cls, raw: object) -> _GpuRecord:
        """What recover needs of a journaled record (``before`` is not read back); raises
        ValueError for a record of the wrong shape."""
        if not isinstance(raw, dict) or not isinstance(uuid := raw.get("uuid"), str):
            raise ValueError(f"journal state: {raw!r} is not a GPU record")
        changed, index = raw.get("changed") or [], raw.get("index")
        power = raw.get("power_limit_mw")
        if not isinstance(changed, list) or not all(op in _UNDO_OP for op in changed):
            raise ValueError(f"journal state: GPU {uuid}: changed is {changed!r}, not a list of "
                             f"{', '.join(_UNDO_OP)}")
        return cls(uuid, index if isinstance(index, int) else None,
                   changed=[str(op) for op in changed],
                   power_limit_mw=power if isinstance(power, int) else None)


def _resolve(spec: GpuClocksFault, nv: Nvml, gpu: Gpu) -> _Plan:
    """Raises ``NvmlError`` from the reads; the caller explains them."""
    sm = spec.sm_clocks_mhz
    if spec.sm_clocks:
        top = nv.max_clock_mhz(gpu.handle, "sm")
        sm = (round(spec.sm_clocks[0] * top), round(spec.sm_clocks[1] * top))
    mem = spec.mem_clocks_mhz
    if spec.mem_clocks:
        top = nv.max_clock_mhz(gpu.handle, "mem")
        mem = (round(spec.mem_clocks[0] * top), round(spec.mem_clocks[1] * top))
    power = round(spec.power_limit_w * 1000) if spec.power_limit_w else None
    if spec.power_limit is not None:
        default_mw = nv.default_power_limit_mw(gpu.handle)
        power = round(spec.power_limit * default_mw)
    return _Plan(sm, mem, power)


def _readback(nv: Nvml, gpu: Gpu) -> JsonDict:
    """What the driver reports now; fields it cannot answer are None."""
    h = gpu.handle

    def watts(read: Callable[[Handle], int]) -> float | None:
        mw = or_none(read, h)
        return mw / 1000.0 if mw is not None else None

    bits = or_none(nv.clock_event_reasons, h)
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "sm_clock_mhz": or_none(nv.clock_mhz, h, "sm"),
        "mem_clock_mhz": or_none(nv.clock_mhz, h, "mem"),
        "max_sm_clock_mhz": or_none(nv.max_clock_mhz, h, "sm"),
        "power_limit_w": watts(nv.power_limit_mw),
        "enforced_power_limit_w": watts(nv.enforced_power_limit_mw),
        "clock_event_reasons": [*decode_reasons(bits)] if bits is not None else None,
    }


def _snapshot(nv: Nvml, gpu: Gpu, plan: _Plan) -> _GpuRecord:
    """Everything revert and recover need, read before any change."""
    record = _GpuRecord(gpu.uuid, gpu.index, _readback(nv, gpu))
    record.before["plan"] = plan.to_json()
    reasons = record.before["clock_event_reasons"]
    record.before["clocks_locked_before"] = (
        None if not isinstance(reasons, list) else "applications_clocks_setting" in reasons
    )
    if plan.power_mw is not None:
        try:
            record.power_limit_mw = nv.power_limit_mw(gpu.handle)
        except NvmlError as exc:
            raise InjectorError(
                explain(exc, "query", gpu, nv) + " The original power limit must be known "
                "before it is changed, so the fault was not applied."
            ) from exc
    return record


def _set(nv: Nvml, gpu: Gpu, op: str, plan: _Plan) -> None:
    if op == "sm_clocks" and plan.sm_mhz:
        nv.lock_sm_clocks(gpu.handle, *plan.sm_mhz)
    elif op == "mem_clocks" and plan.mem_mhz:
        nv.lock_mem_clocks(gpu.handle, *plan.mem_mhz)
    elif op == "power_limit" and plan.power_mw is not None:
        nv.set_power_limit_mw(gpu.handle, plan.power_mw)


def _undo_one(nv: Nvml, gpu: Gpu, op: str, record: _GpuRecord) -> str:
    if op == "sm_clocks":
        nv.reset_sm_clocks(gpu.handle)
        return "SM clocks unlocked"
    if op == "mem_clocks":
        nv.reset_mem_clocks(gpu.handle)
        return "memory clocks unlocked"
    original = record.power_limit_mw
    if original is None:
        raise RevertError(f"{gpu.label}: the journal lacks the original power limit: check "
                          "`nvidia-smi -q -d POWER` and set it by hand.")
    nv.set_power_limit_mw(gpu.handle, original)
    now = or_none(nv.power_limit_mw, gpu.handle)
    if now is not None and now != original:
        raise RevertError(
            f"{gpu.label} reports a power limit of {now / 1000:g} W after restoring "
            f"{original / 1000:g} W: check `nvidia-smi -q -d POWER` and set it by hand."
        )
    return f"power limit back to {original / 1000:g} W"


def _undo_gpu(
    nv: Nvml, record: _GpuRecord, ops: list[str]
) -> tuple[list[str], list[str], list[str]]:
    """Undo ``ops`` (newest first) on one GPU. Returns (done, still pending, problems)."""
    label = f"GPU {record.index} ({record.uuid})"
    try:
        gpu = gpu_by_uuid(nv, record.uuid)
    except NvmlError as exc:
        return [], ops, [explain(exc, _UNDO_OP[ops[-1]], label=label)]
    if gpu is None:
        # The GPU is not on this host any more; a setting cannot outlive its device.
        return ["no longer on this host, nothing to restore"], [], []
    done: list[str] = []
    pending: list[str] = []
    problems: list[str] = []
    for op in reversed(ops):
        try:
            done.append(_undo_one(nv, gpu, op, record))
        except NvmlError as exc:
            if exc.value == _NOT_SUPPORTED and op != "power_limit":
                continue  # no lock can exist where locking is unsupported: already gone
            pending.insert(0, op)
            problems.append(explain(exc, _UNDO_OP[op], gpu, nv))
        except RevertError as exc:
            pending.insert(0, op)
            problems.append(str(exc))
    return done, pending, problems


class GpuClocksInjector:
    def __init__(self, spec: GpuClocksFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.preflight_checks: list[str] = []  # what preflight verified, for the run log
        self._records: list[_GpuRecord] = []
        self._pending: dict[str, list[str]] = {}  # uuid -> ops applied and not yet undone

    def describe(self) -> JsonDict:
        return self.spec.model_dump(mode="json", exclude_none=True)

    # -- preflight --------------------------------------------------------------------------

    def preflight(self) -> list[str]:
        """Checks the driver loads, the GPUs exist, the generation supports each setting and
        the values lie in the supported range. Permission is only known by trying: changing
        clocks or power limits needs root."""
        self.preflight_checks = []
        try:
            with nvml_session() as nv:
                if nv.emulated:
                    self.preflight_checks.append("NVML is streamquake's emulated test driver")
                gpus, problems = select_gpus(nv, self.spec.gpus)
                for gpu in gpus:
                    problems += self._check_gpu(nv, gpu)
        except InjectorError as exc:
            return [str(exc)]
        if os.geteuid() != 0:
            self.preflight_checks.append(
                "not running as root: NVIDIA drivers refuse clock and power changes to other "
                "users, so applying will likely fail with NVML_ERROR_NO_PERMISSION"
            )
        return problems

    def _check_gpu(self, nv: Nvml, gpu: Gpu) -> list[str]:
        try:
            plan = _resolve(self.spec, nv, gpu)
        except NvmlError as exc:
            return [explain(exc, "query", gpu, nv)]
        arch = or_none(nv.architecture, gpu.handle)
        problems: list[str] = []
        checked: list[str] = []
        if plan.sm_mhz:
            problems += self._check_sm(nv, gpu, plan, arch, checked)
        if plan.mem_mhz:
            problems += self._check_mem(nv, gpu, plan, arch, checked)
        if plan.power_mw is not None:
            problems += self._check_power(nv, gpu, plan, checked)
        self.preflight_checks.append(f"{gpu.label} {gpu.name}: " + "; ".join(checked))
        return problems

    def _check_sm(
        self, nv: Nvml, gpu: Gpu, plan: _Plan, arch: int | None, checked: list[str]
    ) -> list[str]:
        assert plan.sm_mhz
        want = plan.requested("sm_clocks")
        if arch is not None and arch < ARCH_VOLTA:
            return [not_supported_message("lock_sm_clocks", gpu, nv, want)]
        rng = supported_sm_range(nv, gpu.handle)
        if rng is None:
            checked.append(f"SM {want} (supported range not reported)")
            return []
        checked.append(f"SM {want} within {rng[0]}-{rng[1]} MHz")
        if plan.sm_mhz[0] < rng[0] or plan.sm_mhz[1] > rng[1]:
            return [out_of_range_message("lock_sm_clocks", gpu, nv, want)]
        return []

    def _check_mem(
        self, nv: Nvml, gpu: Gpu, plan: _Plan, arch: int | None, checked: list[str]
    ) -> list[str]:
        assert plan.mem_mhz
        want = plan.requested("mem_clocks")
        if arch is not None and arch < ARCH_AMPERE:
            return [not_supported_message("lock_mem_clocks", gpu, nv, want)]
        clocks = supported_mem_clocks(nv, gpu.handle)
        if not clocks:
            checked.append(f"memory {want} (supported clocks not reported)")
            return []
        checked.append(f"memory {want} within {min(clocks)}-{max(clocks)} MHz")
        if plan.mem_mhz[0] < min(clocks) or plan.mem_mhz[1] > max(clocks):
            return [out_of_range_message("lock_mem_clocks", gpu, nv, want)]
        return []

    def _check_power(self, nv: Nvml, gpu: Gpu, plan: _Plan, checked: list[str]) -> list[str]:
        assert plan.power_mw is not None
        want = plan.requested("power_limit")
        lim = power_limit_range_w(nv, gpu.handle)
        if lim is None:
            checked.append(f"power {want} (limits not reported)")
            return []
        checked.append(f"power {want} within {lim[0]:g}-{lim[1]:g} W")
        if not lim[0] * 1000 <= plan.power_mw <= lim[1] * 1000:
            return [out_of_range_message("set_power_limit", gpu, nv, want)]
        return []

    # -- apply / revert ---------------------------------------------------------------------

    def apply(self, entry: JournalEntry) -> JsonDict:
        with nvml_session() as nv:
            gpus, problems = select_gpus(nv, self.spec.gpus)
            if problems:
                raise InjectorError(" ".join(problems))
            plans: list[_Plan] = []
            for gpu in gpus:
                try:
                    plans.append(_resolve(self.spec, nv, gpu))
                except NvmlError as exc:
                    raise InjectorError(explain(exc, "query", gpu, nv)) from exc
            # Each setting has one owner, even within a run: a second fault's "original" would be
            # the first's value, and a lock's range cannot be read back to restore it.
            entry.claim({f"gpu:{g.uuid}:{op}": f"the {_SETTING[op]} of {g.label}"
                         for g, p in zip(gpus, plans, strict=True) for op in p.ops()})
            self._records = [_snapshot(nv, g, p) for g, p in zip(gpus, plans, strict=True)]
            entry.save({"gpus": self._journaled(), "emulated_driver": nv.emulated})
            try:
                for gpu, plan, record in zip(gpus, plans, self._records, strict=True):
                    self._apply_gpu(nv, gpu, plan, record, entry)
            except Exception as exc:  # whatever stopped us, leave no half-applied fault behind
                self._roll_back(nv, exc)
                raise
            readback: list[JsonValue] = []
            for gpu, plan in zip(gpus, plans, strict=True):
                readback.append({"requested": plan.to_json(), **_readback(nv, gpu)})
            return {"gpus": readback, "emulated_driver": nv.emulated}

    def _journaled(self) -> list[JsonValue]:
        return [r.to_json() for r in self._records]

    def _apply_gpu(
        self, nv: Nvml, gpu: Gpu, plan: _Plan, record: _GpuRecord, entry: JournalEntry
    ) -> None:
        for op in plan.ops():
            record.changed.append(op)
            entry.save({"gpus": self._journaled()})  # journaled before the driver is touched
            killpoint("gpu.journalled")
            try:
                _set(nv, gpu, op, plan)
                killpoint("gpu.set")
            except NvmlError as exc:
                raise InjectorError(
                    explain(exc, _APPLY_OP[op], gpu, nv, plan.requested(op))
                ) from exc
            self._pending.setdefault(gpu.uuid, []).append(op)

    def _roll_back(self, nv: Nvml, cause: Exception) -> None:
        problems = self._undo_pending(nv)[1]
        if problems:
            raise RevertError(
                f"{cause} Undoing the settings already applied also failed: " + " ".join(problems)
            ) from cause

    def _undo_pending(self, nv: Nvml) -> tuple[list[JsonValue], list[str]]:
        restored: list[JsonValue] = []
        problems: list[str] = []
        for record in self._records:
            ops = self._pending.get(record.uuid, [])
            if not ops:
                continue
            done, pending, errs = _undo_gpu(nv, record, ops)
            self._pending[record.uuid] = pending
            problems += errs
            try:
                gpu = gpu_by_uuid(nv, record.uuid) if not errs else None
            except NvmlError:
                gpu = None  # the read-back is a courtesy; the undo itself succeeded
            restored.append(
                {"uuid": record.uuid, "index": record.index, "restored": [*done],
                 "readback": _readback(nv, gpu) if gpu else None}
            )
        return restored, problems

    def revert(self) -> JsonDict:
        if not any(self._pending.values()):
            return {"gpus": []}
        try:
            with nvml_session() as nv:
                restored, problems = self._undo_pending(nv)
        except InjectorError as exc:
            raise RevertError(f"{exc} The GPU settings could not be restored.") from exc
        if problems:
            raise RevertError(" ".join(problems))
        return {"gpus": restored}

    @classmethod
    def recover(cls, state: Mapping[str, object]) -> str:
        journaled = state.get("gpus") or []
        if not isinstance(journaled, list):
            raise ValueError(f"journal state: gpus is {journaled!r}, not a list of GPU records")
        records = [r for r in map(_GpuRecord.from_json, journaled) if r.changed]
        if not records:
            return "Nothing to restore: no GPU setting had been changed yet."
        try:
            with nvml_session() as nv:
                sentences: list[str] = []
                problems: list[str] = []
                for record in records:
                    done, _, errs = _undo_gpu(nv, record, list(record.changed))
                    problems += errs
                    if done:
                        sentences.append(f"GPU {record.index} ({record.uuid}): "
                                         + ", ".join(done))
        except InjectorError as exc:
            raise RevertError(f"{exc} The GPU settings could not be restored.") from exc
        if problems:
            raise RevertError(" ".join(problems))
        return "Restored " + "; ".join(sentences) + "." if sentences else "Nothing to restore."
