"""The engine family's scenario model. Light on purpose: ``streamquake validate`` imports it."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, field_validator

from streamquake.faults.envelope import FaultSpec
from streamquake.protocols.base import Protocol as FormatName
from streamquake.units import DurationMs, RequestRate

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


# The noisy tenant's bounds: wide enough for any test of a real engine, narrow enough that a
# typo (an extra zero or three) is caught before it floods the target.
MAX_CONCURRENCY = 1024
MAX_TOKENS = 1_000_000
MAX_NOISE_TIMEOUT_MS = 600_000.0


def _noise_timeout(ms: float) -> float:
    if not 0 < ms <= MAX_NOISE_TIMEOUT_MS:
        raise ValueError(f"must be above 0 and at most {MAX_NOISE_TIMEOUT_MS / 1000:g}s, e.g. "
                         "'30s': the longest the tenant waits for the target to answer, or "
                         "between two reads of a stream")
    return ms


def _base_url(v: str, what: str, example: str) -> str:
    parts = urlsplit(v.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{v!r} is not an http(s) URL with a host: write {what}, e.g. {example}")
    if parts.query or parts.fragment:
        raise ValueError(f"{v!r} has a query or fragment: give the base URL alone, e.g. "
                         f"{example}")
    try:
        parts.port  # noqa: B018 - raises for a port out of range
    except ValueError as exc:
        raise ValueError(f"{v!r}: {exc}; e.g. {example}") from None
    return v.strip().rstrip("/")


class NoisyTenantFault(FaultSpec):
    """``{type: noisy_tenant, concurrency: 8, max_tokens: 1024}``: another tenant's long
    requests (long prompts, long answers) against the target for the fault's window, sent by
    the fault (not counted among the scenario's samples), so the scenario's own classes are
    judged while the target serves them too."""

    type: Literal["noisy_tenant"] = "noisy_tenant"
    concurrency: int = Field(
        8, ge=1, le=MAX_CONCURRENCY, description="streams held open at once (with `rate`: at "
        "most this many); each is sent again as soon as it ends")
    rate_per_s: RequestRate | None = Field(
        None, alias="rate", gt=0, description="new requests a second, e.g. '4/s' (left out: "
        "closed loop, `concurrency` streams always open)")
    prompt_tokens: int = Field(
        2000, ge=1, le=MAX_TOKENS, description="words in each request's prompt")
    max_tokens: int = Field(
        1024, ge=1, le=MAX_TOKENS, description="the answer's length each request asks for")
    protocol: FormatName | None = Field(
        None, description="the wire format of its requests (default: the scenario's "
        "target.protocol)")
    path: str | None = Field(
        None, description="the request path (default: the scenario's target.path, else the "
        "format's own)")
    model: str | None = Field(None, description="the model asked for (default: the "
                                                "scenario's target.model)")
    url: str | None = Field(
        None, description="the target's base URL (default: the scenario's target, straight, "
        "not through any proxy of the run's)")
    timeout_ms: Annotated[DurationMs, AfterValidator(_noise_timeout)] = Field(
        30_000.0, alias="timeout", description="the limit on each wait: to connect, for the "
        "answer's head, between two reads of its stream")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _base_url(v, "the target's base URL",
                                                "http://127.0.0.1:8000")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith("/"):
            raise ValueError(f"{v!r} must start with '/', e.g. /v1/chat/completions")
        bad = next((c for c in v if c <= " " or c == "\x7f"), None)
        if bad is not None:
            raise ValueError(f"{v!r} holds {bad!r}: a request path cannot carry spaces or "
                             "control characters (percent-encode them, e.g. %20)")
        return v
