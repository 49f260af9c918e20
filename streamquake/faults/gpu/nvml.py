"""NVML at the boundary: loading the driver library, choosing GPUs, and turning pynvml's errors
into sentences a user can act on.

``pynvml`` (the nvidia-ml-py distribution) is imported only inside functions: importing
streamquake must work, and stay silent, on hosts without an NVIDIA driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, NewType, ParamSpec, TypeVar

from streamquake.errors import InjectorError

GpuSelector = Literal["all"] | list[int | str]
Operation = Literal[
    "init",
    "query",
    "lock_sm_clocks",
    "reset_sm_clocks",
    "lock_mem_clocks",
    "reset_mem_clocks",
    "set_power_limit",
]

# NVML return codes we explain (pynvml's NVML_ERROR_* values; stable across driver versions).
_NO_PERMISSION = 4
_NOT_SUPPORTED = 3
_INVALID_ARGUMENT = 2
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15

ARCH_VOLTA = 5
ARCH_AMPERE = 7
_ARCH_NAMES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere", 8: "Ada",
    9: "Hopper", 10: "Blackwell",
}

_REASON_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

_ACTIONS: dict[Operation, str] = {
    "init": "loading NVML",
    "query": "reading GPU state",
    "lock_sm_clocks": "locking SM clocks",
    "reset_sm_clocks": "resetting locked SM clocks",
    "lock_mem_clocks": "locking memory clocks",
    "reset_mem_clocks": "resetting locked memory clocks",
    "set_power_limit": "setting the power limit",
}

_NOT_SUPPORTED_WHY: dict[Operation, str] = {
    "lock_sm_clocks": "locked GPU clocks (nvmlDeviceSetGpuLockedClocks) need a Volta or newer GPU",
    "reset_sm_clocks": "locked GPU clocks need a Volta or newer GPU",
    "lock_mem_clocks": (
        "locked memory clocks (nvmlDeviceSetMemoryLockedClocks) need an Ampere or newer GPU"
    ),
    "reset_mem_clocks": "locked memory clocks need an Ampere or newer GPU",
    "set_power_limit": (
        "power limits can be set on most datacenter GPUs (Tesla, A-, H-, L-series) but often "
        "not on GeForce, laptop or vGPU devices"
    ),
}


Handle = NewType("Handle", object)   # NVML's opaque device pointer
Clock = Literal["sm", "mem"]
_P = ParamSpec("_P")
_T = TypeVar("_T")


class NvmlError(Exception):
    """A pynvml error, converted at the boundary: ``value`` is NVML's return code, the text
    is pynvml's."""

    def __init__(self, value: int | None, text: str) -> None:
        super().__init__(text)
        self.value = value


class Nvml:
    """The NVML calls the gpu family makes, typed (pynvml has no types); pynvml's errors come
    out as ``NvmlError``. Made by ``nvml_session``."""

    def __init__(self, lib: ModuleType) -> None:
        self._lib = lib
        self._clocks = {"sm": lib.NVML_CLOCK_SM, "mem": lib.NVML_CLOCK_MEM}

    def _call(self, fn: str, *args: object) -> Any:  # the one untyped step: pynvml's answer
        try:
            return getattr(self._lib, fn)(*args)
        except self._lib.NVMLError as exc:
            raise NvmlError(error_code(exc), str(exc)) from exc

    @property
    def emulated(self) -> bool:
        """True when the loaded library is streamquake's test shim rather than a real driver."""
        return hasattr(self._lib.nvmlLib, "fakeNvmlIsEmulated")

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle_by_index(self, index: int) -> Handle:
        return Handle(self._call("nvmlDeviceGetHandleByIndex", index))

    def handle_by_uuid(self, uuid: str) -> Handle:
        return Handle(self._call("nvmlDeviceGetHandleByUUID", uuid))

    def index(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetIndex", h))

    def uuid(self, h: Handle) -> str:
        return _text(self._call("nvmlDeviceGetUUID", h))

    def name(self, h: Handle) -> str:
        return _text(self._call("nvmlDeviceGetName", h))

    def architecture(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetArchitecture", h))

    def clock_mhz(self, h: Handle, clock: Clock) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", h, self._clocks[clock]))

    def max_clock_mhz(self, h: Handle, clock: Clock) -> int:
        return int(self._call("nvmlDeviceGetMaxClockInfo", h, self._clocks[clock]))

    def supported_mem_clocks(self, h: Handle) -> list[int]:
        return [int(c) for c in self._call("nvmlDeviceGetSupportedMemoryClocks", h)]

    def supported_graphics_clocks(self, h: Handle, mem_mhz: int) -> list[int]:
        return [int(c) for c in self._call("nvmlDeviceGetSupportedGraphicsClocks", h, mem_mhz)]

    def lock_sm_clocks(self, h: Handle, low_mhz: int, high_mhz: int) -> None:
        self._call("nvmlDeviceSetGpuLockedClocks", h, low_mhz, high_mhz)

    def lock_mem_clocks(self, h: Handle, low_mhz: int, high_mhz: int) -> None:
        self._call("nvmlDeviceSetMemoryLockedClocks", h, low_mhz, high_mhz)

    def reset_sm_clocks(self, h: Handle) -> None:
        self._call("nvmlDeviceResetGpuLockedClocks", h)

    def reset_mem_clocks(self, h: Handle) -> None:
        self._call("nvmlDeviceResetMemoryLockedClocks", h)

    def power_limit_mw(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetPowerManagementLimit", h))

    def enforced_power_limit_mw(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetEnforcedPowerLimit", h))

    def default_power_limit_mw(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetPowerManagementDefaultLimit", h))

    def power_limit_constraints_mw(self, h: Handle) -> tuple[int, int]:
        low, high = self._call("nvmlDeviceGetPowerManagementLimitConstraints", h)
        return int(low), int(high)

    def set_power_limit_mw(self, h: Handle, mw: int) -> None:
        self._call("nvmlDeviceSetPowerManagementLimit", h, mw)

    def power_usage_mw(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage", h))

    def temperature_c(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetTemperature", h, self._lib.NVML_TEMPERATURE_GPU))

    def utilization_pct(self, h: Handle) -> tuple[int, int]:
        """(GPU, memory) busy percentages over the driver's last sample period."""
        util = self._call("nvmlDeviceGetUtilizationRates", h)
        return int(util.gpu), int(util.memory)

    def memory_used_bytes(self, h: Handle) -> int:
        return int(self._call("nvmlDeviceGetMemoryInfo", h).used)

    def clock_event_reasons(self, h: Handle) -> int:
        """Current clock-event (formerly "throttle") reason bits; old drivers lack the new
        name."""
        try:
            return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", h))
        except NvmlError as exc:
            if exc.value != _FUNCTION_NOT_FOUND:
                raise
        return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons", h))


def or_none(read: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T | None:
    """``read(*args)``; None when the GPU or driver cannot answer."""
    try:
        return read(*args, **kwargs)
    except NvmlError:
        return None


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML numbers it (like ``nvidia-smi``; CUDA_VISIBLE_DEVICES does not apply)."""

    index: int
    uuid: str
    name: str
    handle: Handle

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"


def error_code(exc: BaseException) -> int | None:
    """The NVML return code of a pynvml error, else None."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def arch_name(arch: int | None) -> str:
    return _ARCH_NAMES.get(arch or -1, f"architecture #{arch}")


def explain(
    exc: BaseException,
    operation: Operation,
    gpu: Gpu | None = None,
    nv: Nvml | None = None,
    requested: str = "",
    label: str | None = None,
) -> str:
    """One sentence saying what failed, why, and what to do about it.

    ``nv`` lets it look up the supported range for an out-of-range value;
    ``label`` names the GPU when there is no ``Gpu`` yet (e.g. its handle could not be had).
    """
    code = error_code(exc)
    label = gpu.label if gpu else label
    where = f" on {label}" if label else ""
    action = _ACTIONS[operation] + (f" to {requested}" if requested else "")
    if code == _LIBRARY_NOT_FOUND:
        return (
            "No NVIDIA driver on this host: libnvidia-ml.so.1 could not be loaded. Install the "
            "NVIDIA driver (`nvidia-smi` must work), or start the container with the NVIDIA "
            "Container Toolkit (`docker run --gpus all ...`)."
        )
    if code == _DRIVER_NOT_LOADED:
        return (
            "The NVIDIA kernel driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED): load it "
            "(`modprobe nvidia`) and check that `nvidia-smi` lists the GPUs."
        )
    if code == _NO_PERMISSION:
        return (
            f"{_cap(action)}{where} needs root (NVML_ERROR_NO_PERMISSION): run streamquake "
            "as root (sudo), or in a container as root with --privileged; the NVIDIA driver "
            "refuses clock and power changes to other users."
        )
    if code == _NOT_SUPPORTED:
        return not_supported_message(operation, gpu, nv, requested, label)
    if code == _INVALID_ARGUMENT:
        return out_of_range_message(operation, gpu, nv, requested, label)
    if code == _GPU_IS_LOST:
        return (
            f"{label or 'A GPU'} fell off the bus (NVML_ERROR_GPU_IS_LOST) while "
            f"{action}: the driver lost contact with it (see `dmesg` for an Xid 79). It needs "
            "a GPU reset or a reboot before it can be used or its settings restored."
        )
    if code == _FUNCTION_NOT_FOUND:
        return (
            f"The installed NVIDIA driver is too old for {action} (NVML_ERROR_FUNCTION_NOT_FOUND):"
            " update the driver."
        )
    return f"{_cap(action)}{where} failed: NVML said {exc} (code {code})."


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def not_supported_message(
    operation: Operation,
    gpu: Gpu | None,
    nv: Nvml | None = None,
    requested: str = "",
    label: str | None = None,
) -> str:
    """The sentence for NVML_ERROR_NOT_SUPPORTED (also used by preflight's generation check)."""
    if gpu:
        where = f" on GPU {gpu.index} ({gpu.uuid}, {gpu.name}{_arch_suffix(nv, gpu)})"
    else:
        where = f" on {label}" if label else ""
    action = _ACTIONS[operation] + (f" to {requested}" if requested else "")
    why = _NOT_SUPPORTED_WHY.get(operation, "this GPU or driver does not report it")
    return (
        f"{_cap(action)}{where} is not supported (NVML_ERROR_NOT_SUPPORTED): "
        f"{why}. Remove that setting from the fault or choose other GPUs."
    )


def out_of_range_message(
    operation: Operation,
    gpu: Gpu | None,
    nv: Nvml | None = None,
    requested: str = "",
    label: str | None = None,
) -> str:
    """The sentence for NVML_ERROR_INVALID_ARGUMENT, with the range the GPU does support."""
    label = gpu.label if gpu else label
    where = f" on {label}" if label else ""
    action = _ACTIONS[operation] + (f" to {requested}" if requested else "")
    supported = _supported_range_text(operation, gpu, nv)
    return (
        f"{_cap(action)}{where} is out of range (NVML_ERROR_INVALID_ARGUMENT)"
        f"{supported}. Choose values inside that range."
    )


def _arch_suffix(nv: Nvml | None, gpu: Gpu) -> str:
    arch = or_none(nv.architecture, gpu.handle) if nv else None
    return f", {arch_name(arch)}" if arch is not None else ""


def _supported_range_text(operation: Operation, gpu: Gpu | None, nv: Nvml | None) -> str:
    if gpu is None or nv is None:
        return ""
    if operation in ("lock_sm_clocks", "reset_sm_clocks"):
        rng = supported_sm_range(nv, gpu.handle)
        return f"; it supports SM clocks {rng[0]}-{rng[1]} MHz" if rng else ""
    if operation in ("lock_mem_clocks", "reset_mem_clocks"):
        clocks = supported_mem_clocks(nv, gpu.handle)
        listed = ", ".join(str(c) for c in clocks)
        return f"; it supports memory clocks {listed} MHz" if clocks else ""
    if operation == "set_power_limit":
        lim = power_limit_range_w(nv, gpu.handle)
        return f"; it accepts power limits {lim[0]:g}-{lim[1]:g} W" if lim else ""
    return ""


@contextlib.contextmanager
def nvml_session() -> Iterator[Nvml]:
    """Initialise NVML for the block and yield it; shut it down after.

    Raises ``InjectorError`` with an actionable sentence when the driver is missing.
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise InjectorError(explain(exc, "init")) from exc
    try:
        yield Nvml(pynvml)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def nvml_available() -> bool:
    """True when the NVIDIA driver library loads and initialises. Changes nothing."""
    try:
        with nvml_session():
            return True
    except InjectorError:
        return False


def select_gpus(nv: Nvml, selector: GpuSelector) -> tuple[list[Gpu], list[str]]:
    """Resolve ``all`` / indices / UUIDs to GPUs. Returns (gpus, problems as sentences)."""
    problems: list[str] = []
    try:
        count = nv.device_count()
    except NvmlError as exc:
        return [], [explain(exc, "query")]
    if count == 0:
        return [], ["NVML sees no GPUs on this host: `nvidia-smi -L` should list at least one."]
    wanted: list[int | str] = list(range(count)) if selector == "all" else list(selector)
    gpus: list[Gpu] = []
    seen: set[str] = set()
    for want in wanted:
        try:
            gpu = _one_gpu(nv, want, count)
        except InjectorError as exc:
            problems.append(str(exc))
            continue
        if gpu.uuid not in seen:
            seen.add(gpu.uuid)
            gpus.append(gpu)
    return gpus, problems


def _one_gpu(nv: Nvml, want: int | str, count: int) -> Gpu:
    try:
        if isinstance(want, int):
            if not 0 <= want < count:
                raise InjectorError(
                    f"GPU index {want} does not exist: this host has {count} GPU(s), indices "
                    f"0-{count - 1} as `nvidia-smi -L` numbers them (CUDA_VISIBLE_DEVICES does "
                    "not apply to NVML)."
                )
            handle = nv.handle_by_index(want)
            index = want
        else:
            handle = nv.handle_by_uuid(want)
            index = nv.index(handle)
        return Gpu(index=index, uuid=nv.uuid(handle), name=nv.name(handle), handle=handle)
    except NvmlError as exc:
        if error_code(exc) == _NOT_FOUND:
            raise InjectorError(
                f"No GPU with UUID {want} on this host: `nvidia-smi -L` lists the UUIDs."
            ) from exc
        raise InjectorError(explain(exc, "query", label=f"GPU {want}")) from exc


def gpu_by_uuid(nv: Nvml, uuid: str) -> Gpu | None:
    """The GPU with this UUID, or None when the host has none (other errors propagate)."""
    try:
        handle = nv.handle_by_uuid(uuid)
    except NvmlError as exc:
        if exc.value == _NOT_FOUND:
            return None
        raise
    return Gpu(index=nv.index(handle), uuid=uuid, name=nv.name(handle), handle=handle)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def supported_mem_clocks(nv: Nvml, handle: Handle) -> list[int]:
    return sorted(or_none(nv.supported_mem_clocks, handle) or [], reverse=True)


def supported_sm_range(nv: Nvml, handle: Handle) -> tuple[int, int] | None:
    """(lowest, highest) SM clock in MHz the GPU lists at its top memory clock."""
    mem = supported_mem_clocks(nv, handle)
    if not mem:
        return None
    clocks = or_none(nv.supported_graphics_clocks, handle, mem[0])
    return (min(clocks), max(clocks)) if clocks else None


def power_limit_range_w(nv: Nvml, handle: Handle) -> tuple[float, float] | None:
    lim = or_none(nv.power_limit_constraints_mw, handle)
    return (lim[0] / 1000.0, lim[1] / 1000.0) if lim else None


def decode_reasons(bits: int) -> list[str]:
    """Reason bits as names (``sw_power_cap``...); unknown bits as ``unknown_0x...``."""
    names = [name for bit, name in _REASON_NAMES.items() if bits & bit]
    unknown = bits & ~sum(_REASON_NAMES)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names
