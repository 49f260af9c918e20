"""Configuration of the embedded target: how fast, how long, how flaky the simulated LLM is."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

# Re-exported: the scenario schema and the load plan name protocols through this module.
from streamquake.protocols import Protocol as Protocol
from streamquake.units import DurationMs, Fraction, ScenarioModel

_Frozen = ScenarioModel      # the base every model a scenario is read into shares


class Fixed(_Frozen):
    dist: Literal["fixed"] = "fixed"
    value_ms: DurationMs = Field(alias="value")


class Normal(_Frozen):
    """Normal, truncated at zero."""

    dist: Literal["normal"]
    mean_ms: DurationMs = Field(alias="mean")
    stddev_ms: DurationMs = Field(alias="stddev")


class LogNormal(_Frozen):
    """Lognormal with the given median; ``sigma`` is the shape (std-dev of the log)."""

    dist: Literal["lognormal"]
    median_ms: DurationMs = Field(alias="median")
    sigma: float = Field(ge=0.0, le=3.0)


def _coerce_delay(v: object) -> object:
    # "200ms" is shorthand for {dist: fixed, value: 200ms}.
    if isinstance(v, str | int | float) and not isinstance(v, bool):
        return {"dist": "fixed", "value": v}
    return v


Delay = Annotated[Fixed | Normal | LogNormal, Field(discriminator="dist"),
                  BeforeValidator(_coerce_delay)]


class OutputLength(_Frozen):
    """Tokens to generate: uniform in [min, max]; a request's own max_tokens caps it."""

    # A million tokens is beyond any model's context; more is a typo, not a length.
    min: int = Field(default=64, ge=1, le=1_000_000)
    max: int = Field(default=64, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _ordered(self) -> OutputLength:
        if self.min > self.max:
            raise ValueError(f"'min' ({self.min}) is more than 'max' ({self.max}): no length is "
                             "in that range; swap them or make 'max' at least 'min'")
        return self


class PrefixCache(_Frozen):
    """A prefix (KV) cache per slot, as llama-server keeps one: a request's prompt tokens that a
    slot already holds cost nothing, every other one costs ``prefill_per_token`` before the
    first token. Flushed through llama-server's slots API, which the target then serves."""

    slots: int = Field(default=4, ge=1, le=1024, description="cache slots (llama-server's -np)")
    prefill_per_token_ms: DurationMs = Field(
        default=1.0, alias="prefill_per_token", le=10_000,
        description="time to read one prompt token the cache does not hold (a whitespace word)")


PRIORITIES = (0, 1, 2, 3)     # P0 (served first) to P3, as a request's body field `priority`


class Scheduler(_Frozen):
    """Which waiting stream takes a free slot of ``capacity`` (the batch): by the request's
    ``priority`` (vLLM's body field and ``--scheduling-policy priority``: 0 first, up to 3), then
    by arrival. Without a scheduler the target admits streams in arrival order alone (FIFO)."""

    policy: Literal["priority"] = Field(
        default="priority", description="admit by priority (0 first), then arrival")
    per_priority: dict[Annotated[int, Field(ge=0, le=3)], int] = Field(
        default_factory=dict,
        description="the most streams of a priority in the batch at once, e.g. {3: 6}: P3 never "
        "holds more than 6 slots, so the rest stay for P0-P2; a priority not named may take "
        "every slot")
    preempt: bool = Field(
        default=False,
        description="a P0 that finds the batch full takes the slot of a lower-priority stream "
        "still forming (admitted, its first token not yet sent): that one waits again at its "
        "place in the queue and, readmitted, starts its first token over")

    @model_validator(mode="after")
    def _limits(self) -> Scheduler:
        for p, n in self.per_priority.items():
            if n < 1:
                raise ValueError(f"per_priority: {p}: {n} would never admit a P{p} stream: give "
                                 f"at least 1, or leave P{p} out to let it take every slot")
        return self


class TargetConfig(_Frozen):
    protocols: list[Protocol] = Field(default_factory=lambda: list(typing.get_args(Protocol)))
    ttft: Delay = Field(default_factory=lambda: Fixed.model_validate({"value": "200ms"}))
    itl: Delay = Field(default_factory=lambda: Fixed.model_validate({"value": "20ms"}))
    output_tokens: OutputLength = Field(default_factory=OutputLength)
    reasoning_tokens: int = Field(
        default=0, ge=0,
        description="the first N tokens of every answer are reasoning, streamed as each format "
        "streams thinking (OpenAI's reasoning_content, Anthropic thinking blocks, Gemini thought "
        "parts, the Responses API's reasoning text); the rest are the answer. Formats without "
        "reasoning (llama_cpp, sse, legacy completions) send them as text",
    )
    tool_call: bool = Field(
        default=False,
        description="the answer (after any reasoning) is one call of a function `search` whose "
        "JSON arguments stream a token at a time (OpenAI tool_calls deltas, Anthropic "
        "input_json_delta, the Responses API's function_call_arguments.delta; Gemini sends a "
        "call whole once it is complete). An answer cut short by the request's max_tokens leaves "
        "its arguments unclosed, as a real server's are",
    )
    capacity: int = Field(default=256, ge=1, description="streams served at once; more wait")
    scheduler: Scheduler | None = Field(
        default=None,
        description="admit waiting streams by their request's `priority` (0-3), with per-"
        "priority limits and P0 pre-emption (Scheduler); none: in arrival order (FIFO)")
    error_rate: Fraction = Field(default=0.0, description="fraction answered 500 before "
                                 "streaming")
    seed: int = 0
    gpu_clock_scale: bool = Field(
        default=False,
        description="scale TTFT/ITL by max_sm_clock / current_sm_clock read through NVML",
    )
    sse_event_ids: bool = Field(
        default=False,
        description="an SSE 'id: N' line on every event, so clients can count lost chunks "
        "(chunk_loss). Off by default: the real Gemini, OpenAI and Anthropic APIs send only "
        "data: lines, and the google-genai SDK rejects any other line",
    )
    stamp_send_time: bool = Field(
        default=False,
        description="an SSE comment ': t=<epoch ns>' opening every event, the time taken right "
        "before the event is written, for benchmarks of client timing "
        "(benchmarks/streams_sweep.py). Off by default: the real services send no comments, "
        "and the google-genai SDK, like for 'id:' lines, reads a comment as JSON and fails; "
        "conformant clients (the OpenAI and Anthropic SDKs, browsers) skip it",
    )
    send_log: str | None = Field(
        default=None,
        description="a file the target appends one JSON line to per stream it served: the "
        "response id it put in the stream (OpenAI chunk id, Anthropic message id, Gemini "
        "responseId; none for generic sse), the trace id of the request's W3C traceparent "
        "header, when the request arrived and when each write was "
        "sent (epoch ns), and which writes carried a content event; for benchmarks that join "
        "a client's event times to the true send times (benchmarks/truth.py). A relative path "
        "is relative to the target process's working directory. Off by default",
    )
    prefix_cache: PrefixCache | None = Field(
        default=None,
        description="keep a prefix cache per slot, which prompt tokens already cached skip "
        "and llama-server's slots API (GET /slots, POST /slots/{id}?action=erase) empties; "
        "OpenAI and llama_cpp streams then carry llama-server's `timings` (prompt_n, cache_n). "
        "Off by default: no prefill time, no slots API",
    )
    tls_cert: str | None = None
    tls_key: str | None = None

    @model_validator(mode="after")
    def _batch_limits(self) -> TargetConfig:
        limits = {} if self.scheduler is None else self.scheduler.per_priority
        over = {p: n for p, n in limits.items() if n > self.capacity}
        if over:
            p, n = next(iter(over.items()))
            raise ValueError(f"scheduler.per_priority: {p}: {n} is more than capacity "
                             f"({self.capacity}), the streams served at once: give at most "
                             f"{self.capacity}, or raise capacity")
        return self
