"""gpu: down-clock or power-cap NVIDIA GPUs through NVML (nvidia-ml-py), and GPU telemetry.

Private machinery: ``nvml`` (loading, GPU selection, errors as sentences), ``clocks`` (the
injector: journal the originals, set, read back, restore), ``telemetry`` (the sampler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from streamquake.faults.contract import Family, FaultSpec, FaultType, InjectorFactory, Resource
from streamquake.faults.gpu.spec import GpuClocksFault

if TYPE_CHECKING:
    from streamquake.scenario import Scenario


def _injector() -> InjectorFactory:
    from streamquake.faults.gpu.clocks import GpuClocksInjector

    return GpuClocksInjector  # type: ignore[return-value]


def _resources(scenario: Scenario) -> Sequence[Resource]:
    # Every run records GPU telemetry where NVML is present, faults or not.
    from streamquake.faults.gpu.resources import GpuTelemetry

    return (GpuTelemetry(),)


def _where(spec: FaultSpec, scenario: Scenario) -> str:
    assert isinstance(spec, GpuClocksFault)
    gpus = "every GPU" if spec.gpus == "all" else "GPUs " + ", ".join(map(str, spec.gpus))
    return (f"NVML on {gpus} of this host: originals journalled first, restored exactly on "
            "revert")


FAMILY = Family(
    name="gpu",
    faults=(FaultType("gpu_clocks", GpuClocksFault, _injector,
                      "lock SM or memory clocks, or cap the power limit", _where),),
    resources=_resources,
)
