"""The GPU family's run-long part: telemetry once a second, on every run where NVML is present."""

from __future__ import annotations

from typing import Literal

from streamquake.faults.contract import JsonDict, RunContext, TelemetryChart, Wiring, charted
from streamquake.faults.gpu.telemetry import GpuSampler

CHARTS = (TelemetryChart("sm_clock_mhz", "SM clock", "MHz"),
          TelemetryChart("util_gpu_pct", "GPU utilisation", "%"),
          TelemetryChart("power_w", "Power", "W"))


class GpuTelemetry:
    key = "gpu"
    title = "GPU telemetry (read-only, where NVML is present)"
    stage: Literal["before_target", "after_target"] = "before_target"

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.sampler: GpuSampler | None = None
        self.samples: list[JsonDict] = []

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        if GpuSampler.available():
            self.sampler = GpuSampler(interval_s=self.interval_s)
            self.sampler.start()

    def stop(self) -> None:
        if self.sampler is not None:
            self.samples = self.sampler.stop()
            self.sampler = None

    def report(self) -> JsonDict | None:
        if self.sampler is None and not self.samples:
            return {"available": False}
        return {"available": True, **charted(
            self.samples, "GPU telemetry", "NVML, once a second, on the run's time axis; "
            "shaded: fault windows.", CHARTS, series_by="gpu", series_label="GPU")}
