"""An agent as a scenario names it (``agents: [{name, url, token_env}]``). Light on purpose
(pydantic and the standard library): ``streamquake validate`` imports it."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator

from streamquake.envref import is_env_name
from streamquake.units import DURATION, ScenarioModel, parse_duration_s, text_only

DEFAULT_TOKEN_ENV = "STREAMQUAKE_AGENT_TOKEN"
DEFAULT_LEASE_S = 15.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class AgentRef(ScenarioModel):
    """``{name: gpu-host, url: https://10.0.0.5:7355, token_env: GPU_AGENT_TOKEN, lease: 15s}``.

    The token itself never appears in a scenario: ``token_env`` names the environment variable
    that holds it. ``ca_cert`` verifies the agent's certificate (default: the system's CAs);
    ``client_cert``/``client_key`` answer an agent that asks for one (mTLS).
    """

    name: str
    url: str
    token_env: str = DEFAULT_TOKEN_ENV
    lease_s: Annotated[float, DURATION, BeforeValidator(text_only(parse_duration_s))] = Field(
        default=DEFAULT_LEASE_S, alias="lease", ge=1.0, le=3600.0)
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v == "local":
            raise ValueError("'local' means this host (`at: local`): give the agent another name")
        if not _NAME.match(v):
            raise ValueError("use letters, digits, '-', '_' and '.', e.g. gpu-host-1")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/]+", v):
            raise ValueError("must start with http:// or https:// and name a host, e.g. "
                             "https://10.0.0.5:7355")
        return v.rstrip("/")

    @field_validator("token_env")
    @classmethod
    def _env(cls, v: str) -> str:
        if not is_env_name(v):
            raise ValueError(f"{v!r} is not an environment variable name")
        return v
