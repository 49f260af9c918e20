"""The engine family's scenario model. Light on purpose: ``streamquake validate`` imports it."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, field_validator

from streamquake.faults.envelope import FaultSpec
from streamquake.units import DurationMs

# Shorter than this is no period but a flood of erases: the engine would spend its time
# clearing slots, which is another fault (and an erase of a busy slot waits for it anyway).
MIN_EVERY_MS = 10.0
MAX_TIMEOUT_MS = 60_000.0


def _every(ms: float) -> float:
    if ms < MIN_EVERY_MS:
        raise ValueError(f"must be at least {MIN_EVERY_MS:g}ms (e.g. '250ms'); leave `every` "
                         "out to flush once, as the fault is applied")
    return ms


def _timeout(ms: float) -> float:
    if not 0 < ms <= MAX_TIMEOUT_MS:
        raise ValueError(f"must be above 0 and at most {MAX_TIMEOUT_MS / 1000:g}s, e.g. '2s'")
    return ms


class CacheFlushFault(FaultSpec):
    """``{type: cache_flush, every: 250ms}``: erase the serving engine's KV (prefix) cache
    through llama-server's slots API, once at apply or on a period inside the window."""

    type: Literal["cache_flush"] = "cache_flush"
    every_ms: Annotated[DurationMs, AfterValidator(_every)] | None = Field(
        None, alias="every", description="erase again on this period inside the window "
        "(left out: once, as the fault is applied)")
    slots: Literal["all"] | list[int] = Field(
        "all", description="slot ids to erase, as `GET /slots` lists them, or all")
    url: str | None = Field(
        None, description="the engine's base URL, where `/slots` is (default: the scenario's "
        "target, over http)")
    timeout_ms: Annotated[DurationMs, AfterValidator(_timeout)] = Field(
        2000.0, alias="timeout", description="the limit on each HTTP call to the engine")

    @field_validator("slots", mode="before")
    @classmethod
    def _slots(cls, v: object) -> object:
        items = [v] if isinstance(v, int) and not isinstance(v, bool) else v
        if not isinstance(items, list):
            return items
        if not items:
            raise ValueError("list at least one slot id (e.g. [0, 1]), or write 'all'")
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise ValueError(f"{item!r} is not a slot id: slot ids are whole numbers from "
                                 "0, as `GET /slots` lists them")
        if len(set(items)) != len(items):
            raise ValueError("a slot id is listed twice: list each once")
        return items

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http(s) URL with a host: write the engine's base "
                             "URL, e.g. http://127.0.0.1:8080 (its slots API is under /slots)")
        if parts.query or parts.fragment:
            raise ValueError(f"{v!r} has a query or fragment: give the base URL alone, e.g. "
                             "http://127.0.0.1:8080")
        try:
            parts.port  # noqa: B018 - raises for a port out of range
        except ValueError as exc:
            raise ValueError(f"{v!r}: {exc}; e.g. http://127.0.0.1:8080") from None
        return v.strip().rstrip("/")
