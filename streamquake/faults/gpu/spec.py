"""The GPU family's scenario model. Light on purpose: ``streamquake validate`` imports it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from streamquake.faults.envelope import FaultSpec
from streamquake.units import Fraction, parse_fraction


def _above_zero(frac: float) -> float:
    if frac <= 0.0:
        raise ValueError("a power limit must be above 0%")
    return frac


# No GPU draws this much (a rack does not): past it a value is a mistake, not a cap.
MAX_POWER_W = 100_000.0

class GpuClocksFault(FaultSpec):
    """``{type: gpu_clocks, gpus: all, sm_clocks_mhz: [500, 800], power_limit: 70%}``."""

    type: Literal["gpu_clocks"] = "gpu_clocks"
    gpus: Literal["all"] | list[int | str] = Field("all", description="GPU indexes or UUIDs")
    sm_clocks_mhz: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="lock the SM clock in [low, high] MHz")
    sm_clocks: tuple[float, float] | None = Field(
        None, description="lock the SM clock in [low, high], shares of its maximum")
    mem_clocks_mhz: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="lock the memory clock in [low, high] MHz")
    mem_clocks: tuple[float, float] | None = Field(
        None, description="lock the memory clock in [low, high], shares of its maximum")
    power_limit_w: PositiveFloat | None = Field(None, le=MAX_POWER_W,
                                                description="cap the power, in watts")
    power_limit: Annotated[Fraction, AfterValidator(_above_zero)] | None = Field(
        None, description="cap the power, a share of its default limit")

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: object) -> object:
        items = [v] if isinstance(v, int | str) and v != "all" else v
        if not isinstance(items, list):
            return items
        if not items:
            raise ValueError("list at least one GPU, or write 'all'")
        out: list[int | str] = []
        for item in items:
            if isinstance(item, str) and item.strip().isdigit():
                item = int(item)
            if isinstance(item, str) and not item.startswith(("GPU-", "MIG-")):
                raise ValueError(f"{item!r} is neither a GPU index nor a UUID like 'GPU-...'")
            if isinstance(item, int) and item < 0:
                raise ValueError(f"GPU index {item} cannot be negative")
            out.append(item)
        return out

    @field_validator("sm_clocks", "mem_clocks", mode="before")
    @classmethod
    def _fraction_pair(cls, v: object) -> object:
        if v is None or not isinstance(v, list | tuple):
            return v
        fracs = tuple(parse_fraction(x) for x in v)
        if any(f <= 0.0 for f in fracs):
            raise ValueError("clock percentages must be above 0%")
        return fracs

    @model_validator(mode="after")
    def _consistent(self) -> GpuClocksFault:
        pairs = [
            ("sm_clocks_mhz", "sm_clocks"),
            ("mem_clocks_mhz", "mem_clocks"),
            ("power_limit_w", "power_limit"),
        ]
        for absolute, relative in pairs:
            if getattr(self, absolute) is not None and getattr(self, relative) is not None:
                raise ValueError(f"give either {absolute} or {relative}, not both")
        for name in ("sm_clocks_mhz", "sm_clocks", "mem_clocks_mhz", "mem_clocks"):
            rng = getattr(self, name)
            if rng is not None and rng[0] > rng[1]:
                raise ValueError(f"{name}: the low end must not exceed the high end")
        if all(getattr(self, a) is None and getattr(self, r) is None for a, r in pairs):
            raise ValueError(
                "a gpu_clocks fault needs at least one of sm_clocks_mhz / sm_clocks, "
                "mem_clocks_mhz / mem_clocks, power_limit_w / power_limit"
            )
        return self
