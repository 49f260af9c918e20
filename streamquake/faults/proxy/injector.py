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
* ``error_event``: ``{after, probability, message, protocol}`` per stream: after ``after``
  content events the stream ends with its format's mid-stream error event
  (``WireProtocol.error_event``; the format the request's path names unless ``protocol`` says
  it), then cleanly. A stream that began before the fault came on never gets one.
* ``stop_after``: after N content events nothing more is sent and the connection is held open
  until the client closes it (or the proxy's read timeout passes), then broken off. A stream
  that began before the fault came on is never held.
* ``drop_usage``: the events that carry only the usage count (``WireProtocol.is_usage_event``,
  in the format the request's path names) are dropped.
* ``tool_call``: ``{mode, probability, protocol}`` per stream: the stream's first tool call's
  argument chunks (``WireProtocol.tool_args_delta``) are spoilt: ``cut`` drops all after the
  first, ``duplicate`` sends the first twice, ``reorder`` swaps the first two. A stream that
  began before the fault came on is spared.
* ``seed``: per-stream random generators come from (seed, fault name, stream number).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from streamquake.errors import InjectorError, RevertError
from streamquake.faults.contract import RunContext
from streamquake.faults.proxy.resources import FaultProxy
from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.faults.proxy.wire import KEY_HEADER
from streamquake.journal import JournalEntry

_HTTP_TIMEOUT_S = 5.0
_PREFLIGHT_TIMEOUT_S = 2.0
# `recover` acts only on faults whose run is gone, so their proxy is gone or dying with it: a
# short wait is enough to tell, and `recover` must finish within seconds.
_RECOVER_TIMEOUT_S = 1.0


# --- talking to the proxy -----------------------------------------------------------------------


class ProxyUnreachable(Exception):
    """Nothing answers at the control URL (connection refused, host gone)."""


class ProxyTimeout(InjectorError):
    """The control URL accepted a connection but did not answer in time."""


def _call(method: str, url: str, body: dict[str, Any] | None, timeout_s: float,
          key: str | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header(KEY_HEADER, key)
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
            raise ProxyTimeout(
                f"the SSE proxy at {url} did not answer within {timeout_s:.0f} s"
            ) from exc
        raise InjectorError(f"cannot reach the SSE proxy at {url}: {exc.reason}") from exc
    except TimeoutError as exc:
        raise ProxyTimeout(
            f"the SSE proxy at {url} did not answer within {timeout_s:.0f} s"
        ) from exc
    except ConnectionResetError as exc:
        raise ProxyUnreachable(str(exc)) from exc


def _fault_url(control_url: str, name: str) -> str:
    return f"{control_url.rstrip('/')}/faults/{urllib.parse.quote(name, safe='')}"


def _delete(control_url: str, name: str, key: str | None) -> dict[str, Any]:
    return _call("DELETE", _fault_url(control_url, name), None, _HTTP_TIMEOUT_S, key)


class SSEProxyInjector:
    """Switches one ``SSEProxyFault`` on and off in the run's proxy."""

    type_name = "sse_proxy"

    def __init__(self, spec: SSEProxyFault, ctx: RunContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self._sent = False   # revert removes a fault of this name only if this one sent it

    @property
    def _proxy_url(self) -> str | None:
        proxy = self.ctx.find(FaultProxy)
        return proxy.control_url if proxy is not None else None

    @property
    def _key(self) -> str | None:
        proxy = self.ctx.find(FaultProxy)
        return proxy.control_key if proxy is not None else None

    @property
    def _control_url(self) -> str:
        url = self._proxy_url
        if not url:
            # A run always has one (the family starts it): this is a fault held outside a run.
            raise InjectorError(
                f"fault '{self.spec.label}' needs a streamquake SSE proxy to act in, and none "
                "was named: start a standing one with `streamquake proxy --upstream URL` and "
                "name it (`streamquake inject sse_proxy ... --proxy HOST:PORT`; in the agent's "
                "API, `proxy`)"
            )
        return url

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
        # One owner per proxy: another run's fault would change this one's phase, and one of
        # the same name would replace it. One run's own faults add up, each removed by name.
        where = urllib.parse.urlsplit(url).netloc
        entry.claim({f"proxy:{where}": f"the SSE proxy at {where}"}, per_owner=True)
        key = self._key
        # The key too: `recover` must be able to take the fault out of a proxy left running.
        entry.save({"proxy_control_url": url, "name": self.spec.label,
                    **({"proxy_key": key} if key else {})})
        self._sent = True
        try:
            echo = _call("PUT", _fault_url(url, self.spec.label), self.spec.proxy_params(),
                         _HTTP_TIMEOUT_S, key)
        except ProxyUnreachable as exc:
            raise InjectorError(
                f"cannot apply fault '{self.spec.label}': the SSE proxy at {url} is gone ({exc})"
            ) from exc
        return {"proxy_control_url": url, **echo}

    def revert(self) -> dict[str, Any]:
        url = self._proxy_url
        if not url:
            return {"name": self.spec.label, "removed": False, "note": "no proxy in this run"}
        if not self._sent:
            return {"name": self.spec.label, "removed": False, "note": "never sent to the proxy"}
        try:
            return _delete(url, self.spec.label, self._key)
        except ProxyUnreachable:
            return {"name": self.spec.label, "removed": False,
                    "note": "the proxy process is gone, and the fault ended with it"}
        except InjectorError as exc:
            raise RevertError(
                f"could not remove fault '{self.spec.label}' from the SSE proxy: {exc}; stop the "
                "proxy process to end it"
            ) from exc

    def ended(self) -> str | None:
        """The proxy stopped (its faults went with it), or it no longer holds this fault (a
        new proxy on its port); None while it does, or when it answers too late to tell."""
        url = self._proxy_url
        if not url or not self._sent:
            return None
        where = urllib.parse.urlsplit(url).netloc
        try:
            faults = _call("GET", f"{url.rstrip('/')}/faults", None, _PREFLIGHT_TIMEOUT_S,
                           self._key).get("faults")
        except ProxyUnreachable:
            return f"the SSE proxy at {where} is gone, and the fault ended with it"
        except InjectorError:
            return None
        if isinstance(faults, dict) and self.spec.label not in faults:
            return f"the SSE proxy at {where} no longer holds it"
        return None

    def describe(self) -> dict[str, Any]:
        return {"type": self.type_name, "name": self.spec.label, "phase": self.spec.phase,
                **self.spec.proxy_params()}

    @classmethod
    def recover(cls, state: dict[str, Any]) -> str:
        url, name = state.get("proxy_control_url"), state.get("name")
        if not url or not name:
            return "nothing to undo: the fault was never sent to a proxy"
        try:
            key = state.get("proxy_key")
            answer = _call("DELETE", _fault_url(url, name), None, _RECOVER_TIMEOUT_S,
                           key if isinstance(key, str) else None)
        except ProxyUnreachable:
            return f"fault '{name}' ended with its proxy process ({url} no longer answers)"
        except ProxyTimeout:
            return (f"skipped fault '{name}': its proxy at {url} did not answer within "
                    f"{_RECOVER_TIMEOUT_S:g} s (a dying process, whose run is gone); the fault "
                    "ends with that process")
        except InjectorError as exc:
            raise RevertError(
                f"could not remove fault '{name}' from the SSE proxy at {url}: {exc}; stop the "
                "proxy process to end it"
            ) from exc
        if answer.get("removed"):
            return f"removed fault '{name}' from the SSE proxy at {url}"
        return f"fault '{name}' was no longer active in the SSE proxy at {url}"
