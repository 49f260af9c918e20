"""The SSE proxy family's scenario model (see injector.py for the semantics). Light on purpose:
``streamquake validate`` imports it."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from streamquake.faults.envelope import ENVELOPE, FaultSpec
from streamquake.protocols import Protocol
from streamquake.units import (
    DURATION,
    PERCENTAGE,
    DurationMs,
    DurationS,
    Fraction,
    ScenarioModel,
    Size,
    parse_duration_ms,
    parse_fraction,
)


def _positive_ms(v: object) -> float:
    ms = parse_duration_ms(v)
    if ms <= 0:
        raise ValueError(
            f"must be a positive duration like '200ms', got {v!r}; leave it out instead"
        )
    return ms


def _fraction_or_null(v: object) -> object:
    # A null goes on to the number check ("Input should be a valid number").
    return None if v is None else parse_fraction(v)


PositiveMs = Annotated[float, DURATION, BeforeValidator(_positive_ms)]
_FractionNotNull = Annotated[float, PERCENTAGE, BeforeValidator(_fraction_or_null)]


class _Part(ScenarioModel):
    pass


class Stall(_Part):
    """Pause the stream for ``duration`` before an event, with ``probability`` per event."""

    probability: Fraction = Field(description="of each event")
    duration_ms: PositiveMs = Field(alias="duration", description="how long the stream pauses")


class Abort(_Part):
    """Answer ``status`` before streaming, without contacting the upstream."""

    status: int = Field(ge=400, le=599, description="an HTTP error status such as 503 or 429")
    probability: Fraction = Field(1.0, description="of each request")
    retry_after_s: DurationS | None = Field(default=None, alias="retry_after",
                                            description="sent as Retry-After")

    def retry_after_header(self) -> str | None:
        # Retry-After takes whole seconds (RFC 9110); round up so a client never retries early.
        return None if self.retry_after_s is None else str(math.ceil(self.retry_after_s))


class Reset(_Part):
    """Reset the TCP connection (RST) after ``after_events`` events, with ``probability``."""

    probability: Fraction = Field(1.0, description="of each stream")
    after_events: int = Field(default=0, ge=0, description="events passed on first")


class ErrorEvent(_Part):
    """End the stream with the error event its format's server sends when it gives up
    mid-answer, after ``after`` content events, with ``probability`` per stream."""

    after: int = Field(ge=0, description="content events passed on first")
    probability: Fraction = Field(1.0, description="of each stream")
    message: str | None = Field(None, max_length=500, description="the error's message, "
                                "where the format carries one (default: the format's usual)")
    protocol: Protocol | None = Field(None, description="the wire format to speak (default: "
                                      "the one whose endpoint the request's path names)")


class ToolCall(_Part):
    """Spoil a streamed tool call's JSON arguments, with ``probability`` per stream: ``cut``
    drops every argument chunk after the first (the stream otherwise ends as it would),
    ``duplicate`` sends the first chunk twice, ``reorder`` swaps the first two. The first chunk
    opens the JSON object, so what the client assembles never parses (a chunk repeated inside a
    string value still could)."""

    mode: Literal["cut", "duplicate", "reorder"] = Field(
        description="cut (drop the argument chunks after the first), duplicate (send the first "
        "twice) or reorder (swap the first two)")
    probability: Fraction = Field(1.0, description="of each stream that carries a tool call")
    protocol: Protocol | None = Field(None, description="the wire format whose tool-call "
                                      "events to read (default: the one whose endpoint the "
                                      "request's path names)")


_ACTIONS = (
    "drop", "delay_ms", "first_event_delay_ms", "stall", "truncate_after_events",
    "truncate_after_bytes", "abort", "reset", "corrupt", "error_event", "stop_after",
    "tool_call",
)


class SSEProxyFault(FaultSpec):
    """A fault the SSE proxy applies per event or per stream (see the module docstring)."""

    type: Literal["sse_proxy"]
    drop: Fraction | None = Field(None, description="content events dropped")
    delay_ms: PositiveMs | None = Field(default=None, alias="delay",
                                        description="held back before each event")
    delay_jitter_ms: DurationMs | None = Field(default=None, alias="delay_jitter",
                                               description="the delay varies by up to this much")
    delay_probability: _FractionNotNull = Field(1.0, description="events delayed")
    first_event_delay_ms: PositiveMs | None = Field(default=None, alias="first_event_delay",
                                                    description="held back before the first "
                                                    "event")
    stall: Stall | None = Field(None, description="pause the stream for `duration` before an "
                                "event, with `probability` per event")
    truncate_after_events: int | None = Field(default=None, ge=0, description="end the "
                                              "stream after this many events")
    truncate_after_bytes: Size | None = Field(default=None, ge=0, description="end the "
                                              "stream after this much body")
    abort: Abort | None = Field(None, description="answer `status` (with `retry_after`) "
                                "instead, with `probability`, the upstream never asked")
    reset: Reset | None = Field(None, description="reset the connection (RST) after "
                                "`after_events` events, with `probability`")
    corrupt: Fraction | None = Field(None, description="events whose data is garbled")
    error_event: ErrorEvent | None = Field(None, description="end the stream with its "
                                           "format's mid-stream error event after `after` "
                                           "content events, with `probability`")
    stop_after: int | None = Field(default=None, ge=0, description="after this many content "
                                   "events, send nothing more and hold the stream open (a hung "
                                   "answer) until the client gives up")
    drop_usage: bool = Field(False, description="drop the events that carry only the usage "
                             "count (OpenAI's last chunk under `include_usage`), in the format "
                             "the request's path names")
    tool_call: ToolCall | None = Field(None, description="spoil a streamed tool call's JSON "
                                       "arguments: `mode` cut, duplicate or reorder its "
                                       "argument chunks, with `probability` per stream")
    seed: int | None = Field(None, description="for repeatable random choices")

    @model_validator(mode="after")
    def _coherent(self) -> SSEProxyFault:
        if all(getattr(self, f) is None for f in _ACTIONS) and not self.drop_usage:
            raise ValueError(
                "an sse_proxy fault needs at least one action: drop, delay, first_event_delay, "
                "stall, truncate_after_events, truncate_after_bytes, abort, reset, corrupt, "
                "error_event, stop_after, tool_call or drop_usage"
            )
        if self.delay_jitter_ms is not None and self.delay_ms is None:
            raise ValueError("delay_jitter needs delay: set delay (e.g. '100ms') as well")
        if self.delay_probability != 1.0 and self.delay_ms is None:
            raise ValueError("delay_probability needs delay: set delay (e.g. '100ms') as well")
        return self

    def proxy_params(self) -> dict[str, Any]:
        """The parameters as the proxy's control API takes them (explicit units, no envelope)."""
        params = self.model_dump(mode="json", exclude=set(ENVELOPE), exclude_none=True)
        if self.delay_ms is None:
            params.pop("delay_probability")  # a default that means nothing without a delay
        if not self.drop_usage:
            params.pop("drop_usage")
        return params


def fault_from_params(params: dict[str, Any]) -> SSEProxyFault:
    """Validate what a control API caller sent (``ValidationError`` if it is wrong)."""
    body = {k: v for k, v in params.items() if k not in ENVELOPE}
    return SSEProxyFault.model_validate({"type": "sse_proxy", **body})
