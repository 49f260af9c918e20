"""SSE proxy faults: the scenario model and the injector that drives a running proxy.

The proxy process itself (``proxy_server.py``) does the work; this module only validates the
parameters and switches a fault on and off through the proxy's control API. All HTTP here is
blocking ``urllib`` with timeouts, because the runner is not asyncio.

Semantics, per fault (several may be active at once; their effects add up):

* ``drop``: probability to drop each *content* event. A content event carries generated text:
  its ``data`` is JSON with a non-empty string under ``text``/``content``/``partial_json``/
  ``thinking``/``reasoning_content``/``refusal`` at any depth and no finish marker
  (``finish_reason``/``finishReason``/``stop_reason`` set), or non-JSON data other than
  ``[DONE]``. Everything else (role-only first chunks, usage, finish, ``[DONE]``, Anthropic
  ``message_start``/``content_block_start``/``ping``/``message_delta``/``message_stop``, errors,
  comments) always passes, so a client can still count what it lost.
* ``delay`` (``delay_jitter``: uniform +-, ``delay_probability``): holds an event back; the rest
  of the stream follows it, so every delay adds to the gap before that event and order holds.
* ``first_event_delay``: the same, for the first event of each stream only.
* ``stall``: ``{probability, duration}`` per event: the stream pauses, then carries on.
* ``truncate_after_events`` / ``truncate_after_bytes``: the stream ends cleanly (a proper end
  of the HTTP body) after N events, or exactly N bytes of body (possibly mid-event).
* ``abort``: ``{status, probability, retry_after}``: answer that status (and ``Retry-After``)
  without contacting the upstream.
* ``reset``: ``{probability, after_events}`` per stream: TCP RST after N events.
* ``corrupt``: probability per content event: the JSON payload is cut and garbled.
* ``seed``: per-stream random generators come from (seed, fault name, stream number).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from streamquake.errors import InjectorError, RevertError
from streamquake.injectors.base import RunContext, register
from streamquake.injectors.spec import FaultSpec
from streamquake.journal import JournalEntry
from streamquake.units import parse_duration_ms, parse_duration_s, parse_fraction, parse_size_bytes

CONTROL_PREFIX = "/_streamquake"
_HTTP_TIMEOUT_S = 5.0
_PREFLIGHT_TIMEOUT_S = 2.0
_ENVELOPE = {"type", "name", "phase"}


def _fraction(v: Any) -> float:
    return parse_fraction(v)


def _positive_ms(v: Any) -> float:
    ms = parse_duration_ms(v)
    if ms <= 0:
        raise ValueError(
            f"must be a positive duration like '200ms', got {v!r}; leave it out instead"
        )
    return ms


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Stall(_Part):
    """Pause the stream for ``duration`` before an event, with ``probability`` per event."""

    probability: float
    duration_ms: float = Field(alias="duration")

    _p = field_validator("probability", mode="before")(_fraction)
    _d = field_validator("duration_ms", mode="before")(_positive_ms)


class Abort(_Part):
    """Answer ``status`` before streaming, without contacting the upstream."""

    status: int = Field(ge=400, le=599, description="an HTTP error status such as 503 or 429")
    probability: float = 1.0
    retry_after_s: float | None = Field(default=None, alias="retry_after")

    _p = field_validator("probability", mode="before")(_fraction)

    @field_validator("retry_after_s", mode="before")
    @classmethod
    def _retry_after(cls, v: Any) -> float | None:
        return None if v is None else parse_duration_s(v)

    def retry_after_header(self) -> str | None:
        # Retry-After takes whole seconds (RFC 9110); round up so a client never retries early.
        return None if self.retry_after_s is None else str(math.ceil(self.retry_after_s))


class Reset(_Part):
    """Reset the TCP connection (RST) after ``after_events`` events, with ``probability``."""

    probability: float = 1.0
    after_events: int = Field(default=0, ge=0)

    _p = field_validator("probability", mode="before")(_fraction)


_ACTIONS = (
    "drop", "delay_ms", "first_event_delay_ms", "stall", "truncate_after_events",
    "truncate_after_bytes", "abort", "reset", "corrupt",
)


class SSEProxyFault(FaultSpec):
    """A fault the SSE proxy applies per event or per stream (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["sse_proxy"]
    drop: float | None = None
    delay_ms: float | None = Field(default=None, alias="delay")
    delay_jitter_ms: float | None = Field(default=None, alias="delay_jitter")
    delay_probability: float = 1.0
    first_event_delay_ms: float | None = Field(default=None, alias="first_event_delay")
    stall: Stall | None = None
    truncate_after_events: int | None = Field(default=None, ge=0)
    truncate_after_bytes: int | None = Field(default=None, ge=0)
    abort: Abort | None = None
    reset: Reset | None = None
    corrupt: float | None = None
    seed: int | None = None

    _f = field_validator("drop", "corrupt", "delay_probability", mode="before")(
        lambda v: None if v is None else _fraction(v)
    )
    _d = field_validator("delay_ms", "first_event_delay_ms", mode="before")(
        lambda v: None if v is None else _positive_ms(v)
    )

    @field_validator("delay_jitter_ms", mode="before")
    @classmethod
    def _jitter(cls, v: Any) -> float | None:
        return None if v is None else parse_duration_ms(v)

    @field_validator("truncate_after_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int | None:
        return None if v is None else parse_size_bytes(v)

    @model_validator(mode="after")
    def _coherent(self) -> SSEProxyFault:
        if all(getattr(self, f) is None for f in _ACTIONS):
            raise ValueError(
                "an sse_proxy fault needs at least one action: drop, delay, first_event_delay, "
                "stall, truncate_after_events, truncate_after_bytes, abort, reset or corrupt"
            )
        if self.delay_jitter_ms is not None and self.delay_ms is None:
            raise ValueError("delay_jitter needs delay: set delay (e.g. '100ms') as well")
        if self.delay_probability != 1.0 and self.delay_ms is None:
            raise ValueError("delay_probability needs delay: set delay (e.g. '100ms') as well")
        return self

    def proxy_params(self) -> dict[str, Any]:
        """The parameters as the proxy's control API takes them (explicit units, no envelope)."""
        params = self.model_dump(mode="json", exclude=_ENVELOPE, exclude_none=True)
        if self.delay_ms is None:
            params.pop("delay_probability")  # a default that means nothing without a delay
        return params


def fault_from_params(params: dict[str, Any]) -> SSEProxyFault:
    """Validate what a control API caller sent (``ValidationError`` if it is wrong)."""
    body = {k: v for k, v in params.items() if k not in _ENVELOPE}
    return SSEProxyFault.model_validate({"type": "sse_proxy", **body})


# --- talking to the proxy -----------------------------------------------------------------------


class ProxyUnreachable(Exception):
    """Nothing answers at the control URL (connection refused, host gone)."""


def _call(method: str, url: str, body: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer: dict[str, Any] = json.loads(resp.read() or b"{}")
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise InjectorError(
            f"the SSE proxy answered {exc.code} to {method} {url}: {detail}"
        ) from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError | FileNotFoundError):
            raise ProxyUnreachable(str(exc.reason)) from exc
        if isinstance(exc.reason, TimeoutError):
            raise InjectorError(
                f"the SSE proxy at {url} did not answer within {timeout_s:.0f} s"
            ) from exc
        raise InjectorError(f"cannot reach the SSE proxy at {url}: {exc.reason}") from exc
    except TimeoutError as exc:
        raise InjectorError(
            f"the SSE proxy at {url} did not answer within {timeout_s:.0f} s"
        ) from exc
    except ConnectionResetError as exc:
        raise ProxyUnreachable(str(exc)) from exc


def _fault_url(control_url: str, name: str) -> str:
    return f"{control_url.rstrip('/')}/faults/{urllib.parse.quote(name, safe='')}"


def _delete(control_url: str, name: str) -> dict[str, Any]:
    return _call("DELETE", _fault_url(control_url, name), None, _HTTP_TIMEOUT_S)


@register("sse_proxy")
class SSEProxyInjector:
    """Switches one ``SSEProxyFault`` on and off in the run's proxy."""

    type_name = "sse_proxy"

    def __init__(self, spec: SSEProxyFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx

    @property
    def _control_url(self) -> str:
        if not self.ctx.proxy_control_url:
            raise InjectorError(
                f"fault '{self.spec.label}' needs the streamquake SSE proxy, but this run has "
                "none: the runner must start it (start_proxy) and put its control_url in the "
                "run context"
            )
        return self.ctx.proxy_control_url

    def preflight(self) -> list[str]:
        try:
            url = self._control_url
        except InjectorError as exc:
            return [str(exc)]
        try:
            _call("GET", f"{url.rstrip('/')}/faults", None, _PREFLIGHT_TIMEOUT_S)
        except ProxyUnreachable as exc:
            return [f"the SSE proxy control API at {url} refuses connections ({exc}); "
                    "is the proxy process running?"]
        except InjectorError as exc:
            return [str(exc)]
        return []

    def apply(self, entry: JournalEntry) -> dict[str, Any]:
        url = self._control_url
        entry.save({"proxy_control_url": url, "name": self.spec.label})
        try:
            echo = _call("PUT", _fault_url(url, self.spec.label), self.spec.proxy_params(),
                         _HTTP_TIMEOUT_S)
        except ProxyUnreachable as exc:
            raise InjectorError(
                f"cannot apply fault '{self.spec.label}': the SSE proxy at {url} is gone ({exc})"
            ) from exc
        return {"proxy_control_url": url, **echo}

    def revert(self) -> dict[str, Any]:
        if not self.ctx.proxy_control_url:
            return {"name": self.spec.label, "removed": False, "note": "no proxy in this run"}
        try:
            return _delete(self.ctx.proxy_control_url, self.spec.label)
        except ProxyUnreachable:
            return {"name": self.spec.label, "removed": False,
                    "note": "the proxy process is gone, and the fault ended with it"}
        except InjectorError as exc:
            raise RevertError(
                f"could not remove fault '{self.spec.label}' from the SSE proxy: {exc}; stop the "
                "proxy process to end it"
            ) from exc

    def describe(self) -> dict[str, Any]:
        return {"type": self.type_name, "name": self.spec.label, "phase": self.spec.phase,
                **self.spec.proxy_params()}

    @classmethod
    def recover(cls, state: dict[str, Any]) -> str:
        url, name = state.get("proxy_control_url"), state.get("name")
        if not url or not name:
            return "nothing to undo: the fault was never sent to a proxy"
        try:
            answer = _delete(url, name)
        except ProxyUnreachable:
            return f"fault '{name}' ended with its proxy process ({url} no longer answers)"
        except InjectorError as exc:
            raise RevertError(
                f"could not remove fault '{name}' from the SSE proxy at {url}: {exc}; stop the "
                "proxy process to end it"
            ) from exc
        if answer.get("removed"):
            return f"removed fault '{name}' from the SSE proxy at {url}"
        return f"fault '{name}' was no longer active in the SSE proxy at {url}"
