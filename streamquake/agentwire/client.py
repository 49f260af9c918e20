"""A blocking client for the agent's API (the runner is threads, not asyncio; so is the CLI).

Every call has a connect timeout and a read timeout. Apply, renew and revert send the owner key
(``owner_key``; default: this user's, ``streamquake.agentwire.owner``). Errors are
``InjectorError`` sentences that name the agent: ``AgentUnreachable`` (nothing answered:
refused, no route, timed out, TLS failed), ``AgentRefused`` (it answered with an error status;
``.status``, ``.problem``).
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, JsonValue, ValidationError

from streamquake.agentwire.api import (
    OWNER_KEY_HEADER,
    AgentInfo,
    ApplyRequest,
    HeldFault,
    HeldFaults,
    Problem,
    Problems,
    Renew,
    Reverted,
    RevertedAll,
    WatchedRun,
    WatchRun,
)
from streamquake.agentwire.owner import user_owner_key
from streamquake.agentwire.ref import AgentRef
from streamquake.errors import InjectorError

M = TypeVar("M", bound=BaseModel)
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0
APPLY_READ_TIMEOUT_S = 75.0     # the agent's preflight + apply deadlines, and a margin


class AgentUnreachable(InjectorError):
    """Nothing answered at the agent's URL."""


class AgentRefused(InjectorError):
    """The agent answered with an error status."""

    def __init__(self, message: str, status: int, problem: Problem) -> None:
        super().__init__(message)
        self.status = status
        self.problem = problem


@dataclass(frozen=True)
class TlsFiles:
    """``ca_cert`` verifies the agent (default: the system's CAs); the pair answers mTLS."""

    ca_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_cert) if self.ca_cert else None)
        if self.client_cert is not None:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def token_from_env(env_name: str) -> str | None:
    return os.environ.get(env_name) or None


class AgentClient:
    def __init__(self, url: str, token: str | None, *, tls: TlsFiles | None = None,
                 label: str | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S, owner_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InjectorError(f"{url!r} is not an agent URL: write e.g. https://host:7355")
        self.url = url.rstrip("/")
        self.label = f"agent {label} ({self.url})" if label else f"the agent at {self.url}"
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._token = token
        self._tls = tls or TlsFiles()
        self._owner_key = owner_key
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s

    # -- the API -------------------------------------------------------------------------------

    def info(self) -> AgentInfo:
        return self._call("GET", "/v1/info", None, AgentInfo)

    def preflight(self, req: ApplyRequest) -> list[str]:
        return self._call("POST", "/v1/preflight", req, Problems,
                          read_timeout_s=APPLY_READ_TIMEOUT_S).problems

    def apply(self, req: ApplyRequest) -> HeldFault:
        return self._call("POST", "/v1/faults", req, HeldFault,
                          read_timeout_s=APPLY_READ_TIMEOUT_S, owned=True)

    def faults(self) -> HeldFaults:
        return self._call("GET", "/v1/faults", None, HeldFaults)

    def renew(self, key: str, lease_s: float | None = None,
              read_timeout_s: float | None = None) -> HeldFault:
        body = Renew() if lease_s is None else Renew(lease=lease_s)   # None: the same lease
        return self._call("POST", f"/v1/faults/{_quote(key)}/renew", body, HeldFault,
                          read_timeout_s=read_timeout_s, owned=True)

    def revert(self, key: str, read_timeout_s: float = APPLY_READ_TIMEOUT_S,
               force: bool = False) -> Reverted:
        """``force``: even another owner's (an operator's emergency; the agent logs it)."""
        return self._call("DELETE", f"/v1/faults/{_quote(key)}{_force(force)}", None, Reverted,
                          read_timeout_s=read_timeout_s, owned=True)

    def revert_all(self, force: bool = False) -> RevertedAll:
        """Every fault this owner holds there; ``force``: every fault held there."""
        return self._call("DELETE", f"/v1/faults{_force(force)}", None, RevertedAll,
                          read_timeout_s=APPLY_READ_TIMEOUT_S, ok=(200, 500), owned=True)

    def watch_run(self, req: WatchRun) -> WatchedRun:
        return self._call("POST", "/v1/runs", req, WatchedRun)

    def renew_run(self, key: str, read_timeout_s: float | None = None) -> WatchedRun:
        return self._call("POST", f"/v1/runs/{_quote(key)}/renew", Renew(), WatchedRun,
                          read_timeout_s=read_timeout_s)

    def end_run(self, key: str) -> WatchedRun:
        return self._call("DELETE", f"/v1/runs/{_quote(key)}", None, WatchedRun)

    # -- the wire ------------------------------------------------------------------------------

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if not self._https:
            return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            ctx = self._tls.context()
        except (ssl.SSLError, OSError) as exc:
            raise InjectorError(f"cannot load the TLS files for {self.label}: {exc}") from exc
        return http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                           context=ctx)

    def _call(self, method: str, path: str, body: BaseModel | None, answer: type[M], *,
              read_timeout_s: float | None = None, ok: tuple[int, ...] = (200, 201),
              owned: bool = False) -> M:
        # None is "not given" (the agent refuses an explicit null lease).
        data = (None if body is None
                else body.model_dump_json(by_alias=True, exclude_none=True).encode())
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        if owned:
            headers[OWNER_KEY_HEADER] = self._owner_key or user_owner_key()
        conn = self._connection(self.connect_timeout_s)
        what = f"{method} {path}"
        try:
            conn.connect()
            if conn.sock is not None:
                conn.sock.settimeout(read_timeout_s or self.read_timeout_s)
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except ssl.SSLError as exc:
            raise AgentUnreachable(
                f"{self.label}: the TLS handshake failed ({exc.reason or exc}); check its "
                "certificate against the CA you gave (ca_cert / --ca-cert), and give a client "
                "certificate if it asks for one (mTLS)") from exc
        except TimeoutError as exc:
            raise AgentUnreachable(f"{self.label} did not answer {what} in time "
                                   f"({exc or 'timed out'})") from exc
        except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
            hint = ("; over https that usually means it wants a client certificate (mTLS): "
                    "give --client-cert and --client-key (client_cert, client_key in a "
                    "scenario)") if self._https else "; is it a streamquake agent?"
            raise AgentUnreachable(f"{self.label} closed the connection without answering "
                                   f"{what}{hint}") from exc
        except (OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "strerror", None) or exc.__class__.__name__
            raise AgentUnreachable(f"{self.label} is unreachable ({reason}); is it running, "
                                   "and can this host reach it?") from exc
        finally:
            conn.close()
        return self._decode(status, raw, answer, ok, what)

    def _decode(self, status: int, raw: bytes, answer: type[M], ok: tuple[int, ...],
                what: str) -> M:
        try:
            parsed: JsonValue = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InjectorError(f"{self.label} answered {what} with {status} and a body that is "
                                "not JSON: is that URL a streamquake agent?") from None
        if status not in ok:
            try:
                problem = Problem.model_validate(parsed)
            except ValidationError:
                problem = Problem(error=f"HTTP {status}")
            raise AgentRefused(f"{self.label} refused {what} ({status}): {problem.error}",
                               status, problem)
        try:
            return answer.model_validate(parsed)
        except ValidationError as exc:
            raise InjectorError(f"{self.label} answered {what} in a form this streamquake does "
                                f"not understand ({exc.error_count()} problem(s)): run the same "
                                "streamquake version on both sides") from exc


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="")


def _force(force: bool) -> str:
    return "?force=true" if force else ""


def _tls(ca: str | None, cert: str | None, key: str | None) -> TlsFiles:
    return TlsFiles(ca_cert=Path(ca) if ca else None, client_cert=Path(cert) if cert else None,
                    client_key=Path(key) if key else None)


def agent_client(ref: AgentRef, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S) -> AgentClient:
    """A client for a scenario's agent; it sends this user's owner key (``agentwire.owner``), so a
    killed run's ``recover`` still owns what the run applied."""
    return AgentClient(ref.url, os.environ.get(ref.token_env) or None,
                       tls=_tls(ref.ca_cert, ref.client_cert, ref.client_key), label=ref.name,
                       connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
