"""GPU telemetry during a run: one sample per GPU per interval, read through NVML on a thread.

A GPU that errors mid-run (fell off the bus, stopped answering) records the error in its
samples and the sampler keeps going; nothing here raises into the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from streamquake.errors import InjectorError, PreflightError
from streamquake.faults.gpu.nvml import (
    Gpu,
    GpuSelector,
    Nvml,
    NvmlError,
    arch_name,
    decode_reasons,
    explain,
    nvml_available,
    nvml_session,
    or_none,
    power_limit_range_w,
    select_gpus,
    supported_mem_clocks,
    supported_sm_range,
)
from streamquake.jsontypes import JsonDict

_GPU_IS_LOST = 15
_MIB = 1 << 20
_T = TypeVar("_T")


def _unless_lost(read: Callable[[], _T]) -> _T | None:
    """``read()``; None when the GPU does not report it, but GPU_IS_LOST propagates."""
    try:
        return read()
    except NvmlError as exc:
        if exc.value == _GPU_IS_LOST:
            raise
        return None


def _sample(nv: Nvml, gpu: Gpu) -> JsonDict:
    """One reading; a field the GPU does not report is None. GPU_IS_LOST propagates."""
    h = gpu.handle
    util = _unless_lost(lambda: nv.utilization_pct(h))
    used = _unless_lost(lambda: nv.memory_used_bytes(h))
    power_mw = _unless_lost(lambda: nv.power_usage_mw(h))
    bits = _unless_lost(lambda: nv.clock_event_reasons(h))
    return {
        "sm_clock_mhz": _unless_lost(lambda: nv.clock_mhz(h, "sm")),
        "mem_clock_mhz": _unless_lost(lambda: nv.clock_mhz(h, "mem")),
        "util_gpu_pct": util[0] if util is not None else None,
        "util_mem_pct": util[1] if util is not None else None,
        "mem_used_mib": round(used / _MIB, 1) if used is not None else None,
        "temperature_c": _unless_lost(lambda: nv.temperature_c(h)),
        "power_w": power_mw / 1000.0 if power_mw is not None else None,
        "clock_event_reasons": [*decode_reasons(bits)] if bits is not None else None,
    }


class GpuSampler:
    """``start()``, then ``stop()`` returns every sample taken, oldest first.

    Each sample: ``t`` (epoch s), ``gpu`` (NVML index), ``uuid``, ``sm_clock_mhz``,
    ``mem_clock_mhz``, ``util_gpu_pct``, ``util_mem_pct``, ``mem_used_mib``, ``temperature_c``,
    ``power_w``, ``clock_event_reasons`` (names); a GPU that cannot be read gives a sample with
    ``error`` (a sentence) instead of readings.
    """

    def __init__(self, interval_s: float = 1.0, gpus: GpuSelector = "all") -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.gpus = gpus
        self._samples: list[JsonDict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the sampler could not run at all, if it could not

    @staticmethod
    def available() -> bool:
        """True when NVML loads here; when False the runner skips GPU telemetry."""
        return nvml_available()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("GpuSampler.start() called twice")
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> list[JsonDict]:
        """Stop sampling and return all samples. Safe to call twice, or without ``start()``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.samples()

    def samples(self) -> list[JsonDict]:
        """A copy of the samples so far (the run may read them live)."""
        with self._lock:
            return list(self._samples)

    def _run(self) -> None:
        try:
            with nvml_session() as nv:
                gpus, problems = select_gpus(nv, self.gpus)
                if problems:
                    self.error = " ".join(problems)
                self._loop(nv, gpus)
        except Exception as exc:  # a sampler must never take the run down with it
            self.error = f"GPU telemetry stopped: {exc}"

    def _loop(self, nv: Nvml, gpus: list[Gpu]) -> None:
        started = time.monotonic()
        tick = 0
        while not self._stop.is_set():
            now = time.time()
            batch = [self._one(nv, gpu, now) for gpu in gpus]
            with self._lock:
                self._samples.extend(batch)
            tick += 1
            # Scheduled from the start, so slow reads do not make the rate drift.
            self._stop.wait(max(0.0, started + tick * self.interval_s - time.monotonic()))

    def _one(self, nv: Nvml, gpu: Gpu, now: float) -> JsonDict:
        base: JsonDict = {"t": now, "gpu": gpu.index, "uuid": gpu.uuid}
        try:
            return {**base, **_sample(nv, gpu)}
        except NvmlError as exc:
            return {**base, "error": explain(exc, "query", gpu)}


def describe_gpus() -> list[JsonDict]:
    """What NVML knows about each GPU, read-only: for `streamquake check` and reports.

    Raises ``PreflightError`` when there is no usable NVIDIA driver.
    """
    try:
        with nvml_session() as nv:
            gpus, problems = select_gpus(nv, "all")
            driver = or_none(nv.driver_version)
            return [_describe(nv, gpu, driver) for gpu in gpus] + [
                {"error": p} for p in problems
            ]
    except InjectorError as exc:
        raise PreflightError(str(exc)) from exc


def _describe(nv: Nvml, gpu: Gpu, driver: str | None) -> JsonDict:
    h = gpu.handle
    sm = supported_sm_range(nv, h)
    mem = supported_mem_clocks(nv, h)
    power = power_limit_range_w(nv, h)
    default_mw = or_none(nv.default_power_limit_mw, h)
    arch = or_none(nv.architecture, h)
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "driver": driver,
        "architecture": arch_name(arch) if arch is not None else None,
        "max_sm_clock_mhz": or_none(nv.max_clock_mhz, h, "sm"),
        "max_mem_clock_mhz": or_none(nv.max_clock_mhz, h, "mem"),
        "supported_sm_clocks_mhz": {"min": sm[0], "max": sm[1]} if sm else None,
        "supported_mem_clocks_mhz": [*mem] if mem else None,
        "power_limit_w": {
            "default": default_mw / 1000.0 if default_mw is not None else None,
            "min": power[0] if power else None,
            "max": power[1] if power else None,
        },
        "emulated": nv.emulated,
    }
