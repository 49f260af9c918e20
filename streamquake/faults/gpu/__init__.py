"""gpu: down-clock or power-cap NVIDIA GPUs through NVML (nvidia-ml-py), and GPU telemetry.

Private machinery: ``nvml`` (loading, GPU selection, errors as sentences), ``clocks`` (the
injector: journal the originals, set, read back, restore), ``telemetry`` (the sampler).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from streamquake.faults.contract import (
    AgentAbility,
    AllowOption,
    Allows,
    Family,
    FaultSpec,
    FaultType,
    HoldRequest,
    InjectorFactory,
    Resource,
    ScenarioView,
)
from streamquake.faults.gpu.spec import GpuClocksFault


def _injector() -> InjectorFactory[GpuClocksFault]:
    from streamquake.faults.gpu.clocks import GpuClocksInjector

    return GpuClocksInjector


def _resources(scenario: ScenarioView) -> Sequence[Resource]:
    # Every run records GPU telemetry where NVML is present, faults or not.
    from streamquake.faults.gpu.resources import GpuTelemetry

    return (GpuTelemetry(),)


def _where(spec: GpuClocksFault, scenario: ScenarioView) -> str:
    gpus = "every GPU" if spec.gpus == "all" else "GPUs " + ", ".join(map(str, spec.gpus))
    return (f"NVML on {gpus} of this host: originals journalled first, restored exactly on "
            "revert")


def _refusal(spec: FaultSpec, allows: Allows, request: HoldRequest) -> str | None:
    gpus = allows.get("gpus")
    if not isinstance(spec, GpuClocksFault) or gpus is None:
        return None
    allowed = ", ".join(sorted(gpus))
    if spec.gpus == "all":
        return (f"`gpus: all` would touch every GPU, and this agent may touch only "
                f"{allowed}: list them")
    outside = [str(g) for g in spec.gpus if str(g) not in gpus]
    if outside:
        return (f"this agent may not touch GPU {', '.join(outside)}; it may touch only "
                f"{allowed} (give GPUs as the agent lists them, index or UUID)")
    return None


def _capabilities() -> Mapping[str, bool]:
    from streamquake.faults.gpu.nvml import nvml_available

    return {"nvml": nvml_available()}


FAMILY = Family(
    name="gpu",
    faults=(FaultType[GpuClocksFault]("gpu_clocks", GpuClocksFault, _injector,
                                      "lock SM or memory clocks, or cap the power limit",
                                      _where),),
    resources=_resources,
    agent=AgentAbility(
        options=(AllowOption("gpus", "GPUs gpu_clocks may touch, by index or UUID (default: "
                             "any).", "GPUs"),),
        refusal=_refusal, capabilities=_capabilities),
)
