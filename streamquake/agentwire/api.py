"""The agent's HTTP API, typed: every body that crosses the wire is one of these models.

Version 1, under ``/v1``; every call needs ``Authorization: Bearer <token>`` when the agent has
a token (it always has one off loopback). Applying a fault needs an owner key too (the header
``Streamquake-Owner-Key``, 16 to 256 random characters): renewing and reverting it need the same
key, unless a revert says ``?force=true`` (an operator's emergency; the agent logs it loudly).
The key is kept secret: never listed, never logged::

    GET    /v1/info               who and what: version, host, allowlist, capabilities
    POST   /v1/preflight          ApplyRequest -> Problems: would this apply? (changes nothing)
    POST   /v1/faults             ApplyRequest -> HeldFault (201): apply, hold under a lease
    GET    /v1/faults             -> HeldFaults
    POST   /v1/faults/{key}/renew Renew -> HeldFault: the lease runs ``lease`` from now
    DELETE /v1/faults/{key}       -> Reverted: revert now ({key}: the id or the name)
    DELETE /v1/faults             -> RevertedAll: revert everything this owner key holds (force:
                                     everything held)
    POST   /v1/runs               WatchRun -> WatchedRun (201): watch a local run under a lease
    POST   /v1/runs/{id}/renew    Renew -> WatchedRun: the run's lease runs ``lease`` from now
    DELETE /v1/runs/{id}          -> WatchedRun: the run ended; stop watching it

The ``/v1/runs`` calls exist only on an agent started with ``--watch-runs JOURNAL`` (the local
agent is): when a watched run's lease lapses, the agent undoes every entry that run owns in that
journal, alive or not, exactly as ``streamquake recover`` would for a dead one.

Errors come back as ``Problem`` with a status: 400 a bad request (the sentence says which
field, or the body nests deeper than ``MAX_JSON_DEPTH``), 401 no or a wrong token, 403 outside
this agent's allowlist or another owner's fault, 404 nothing of that id or name is held, 409 a
name already held, 410 it was held and has ended (``Problem.ended`` says how), 422 the fault's
own preflight or apply refused, 500 a revert that failed (the agent keeps retrying).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue

from streamquake.units import DURATION, parse_duration_s

API_VERSION = 1
DEFAULT_PORT = 7355
OWNER_KEY_HEADER = "Streamquake-Owner-Key"
MAX_JSON_DEPTH = 32
# "ended by itself": the part it acted in went away (faults/contract.py EndsByItself).
EndedBy = Literal["request", "lease expiry", "shutdown", "ended by itself"]
FaultState = Literal["held", "reverting", "revert failed"]


class _Body(BaseModel):
    """What a client sends: unknown fields are mistakes."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Answer(BaseModel):
    """What the agent sends: fields a newer agent adds are ignored, not fatal."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def _lease(v: object) -> float:
    """Seconds as a JSON number, or a duration string; ``true`` (an int to Python), ``null`` or
    a list is a mistake, not a lease."""
    try:
        if isinstance(v, str):
            return parse_duration_s(v)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    except ValueError:
        pass
    raise ValueError(f'give seconds as a number (e.g. 30) or a duration such as "30s", not '
                     f"{json.dumps(v, default=str)}")


Lease = Annotated[float, DURATION, BeforeValidator(_lease)]
# Renewing may leave the lease as it was, but only by leaving it out: a null is a mistake.
_RenewLease = Annotated[float | None, DURATION, BeforeValidator(_lease)]


class TargetAddr(_Body):
    """Where the fault's target lives, for faults that shape the path to it (tc's scope)."""

    host: str
    port: int = Field(ge=1, le=65535)   # port 0 names no service to shape


class ApplyRequest(_Body):
    """A fault as a scenario writes it (``{type: netem, delay: 100ms}``), held for ``lease``."""

    fault: dict[str, JsonValue]
    lease_s: Lease = Field(alias="lease", gt=0, le=7 * 24 * 3600)
    owner: str = ""
    id: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,32}$")
    target: TargetAddr | None = None
    network: dict[str, JsonValue] | None = None
    # A standing SSE proxy (`streamquake proxy`) that an sse_proxy fault goes into: HOST:PORT,
    # its URL, or its control URL, as the agent's host reaches it.
    proxy: str | None = Field(default=None, max_length=2048)


class Renew(_Body):
    lease_s: _RenewLease = Field(default=None, alias="lease", gt=0, le=7 * 24 * 3600)


class WatchRun(_Body):
    """A local run asks to be watched: its pid (and start time) own entries in ``journal``."""

    pid: int = Field(gt=0)
    pid_start: int | None = None
    journal: str
    label: str = ""
    lease_s: Lease = Field(alias="lease", gt=0, le=24 * 3600)


RunState = Literal["watched", "reverting", "ended"]


class WatchedRun(_Answer):
    id: str
    pid: int
    label: str
    state: RunState
    lease_s: float
    expires_at: float
    remaining_s: float
    renewals: int
    ended_by: EndedBy | None = None
    recovered: list[str] = Field(default_factory=list)   # what a lapse undid, line by line


class HeldFault(_Answer):
    id: str
    name: str
    type: str
    owner: str
    host: str
    state: FaultState
    lease_s: float
    applied_at: float
    expires_at: float             # epoch seconds; the agent reverts at this time unless renewed
    remaining_s: float
    renewals: int
    spec: dict[str, JsonValue]
    applied: dict[str, JsonValue]  # the injector's apply result, with its read-back
    error: str | None = None       # the last failed revert, while it is retried


class HeldFaults(_Answer):
    host: str
    faults: list[HeldFault]


class Reverted(_Answer):
    id: str
    name: str
    type: str
    owner: str
    host: str
    by: EndedBy
    applied_at: float
    reverted_at: float
    reverted: dict[str, JsonValue]


class RevertedAll(_Answer):
    reverted: list[Reverted]
    failed: list[str]             # sentences: what may still be in place
    skipped: list[str] = Field(default_factory=list)   # other owners' faults, left held


class Problems(_Answer):
    problems: list[str]


class Problem(_Answer):
    """An error: ``error`` is a sentence for people; ``problems`` lists each when several."""

    error: str
    problems: list[str] = Field(default_factory=list)
    ended: Reverted | None = None


class Allowed(_Answer):
    """What this agent may touch: its fault types, and the values of each family's allowlist
    option by name (``interfaces``, ``gpus``, ``proxies`` as HOST:PORT...); None: anything (of
    the types it has)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    types: list[str]
    __pydantic_extra__: dict[str, list[str] | None] = Field(init=False)


class AgentInfo(_Answer):
    agent: Literal["streamquake"] = "streamquake"
    api: int
    version: str
    host: str
    pid: int
    started_at: float
    state_dir: str
    allow: Allowed
    fault_types: dict[str, str]        # type -> summary, for the types allowed here
    unavailable: dict[str, str]        # type -> why it cannot work on this host
    capabilities: dict[str, bool]      # root, cap_net_admin, nvml
    recovered: list[str]               # what this agent undid at start (its last incarnation's)
    held: int
