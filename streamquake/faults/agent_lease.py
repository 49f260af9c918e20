"""A fault held by an agent on another host, as the journal keeps it: the run's remote controller
(``run/remote.py``) journals each one as an ``agent_lease`` entry (the agent, the fault's id
there, the lease's end) and ``recover`` undoes it here by asking that agent to revert it, or by
confirming that its lease has ended."""

from __future__ import annotations

import time

from streamquake.agentwire.client import AgentRefused, AgentUnreachable, agent_client
from streamquake.agentwire.ref import AgentRef
from streamquake.errors import InjectorError, RevertError
from streamquake.units import format_clock

JOURNAL_TYPE = "agent_lease"


def recover_lease(state: dict[str, object]) -> str:
    """``streamquake recover`` for a remote fault a killed run left: ask its agent to revert
    it; if the agent cannot be reached, the lease's end says whether it has already."""
    url, fault_id = state.get("url"), state.get("fault_id")
    if not isinstance(url, str) or not isinstance(fault_id, str):
        return "nothing to undo: the fault was never sent to an agent"
    name = str(state.get("agent") or url)

    def text(key: str) -> str | None:
        v = state.get(key)
        return v if isinstance(v, str) else None

    ref = AgentRef(name=name if name != "local" else "agent", url=url,
                   token_env=text("token_env") or "STREAMQUAKE_AGENT_TOKEN",
                   ca_cert=text("ca_cert"), client_cert=text("client_cert"),
                   client_key=text("client_key"))
    expires = state.get("expires_at")
    try:
        done = agent_client(ref, connect_timeout_s=2.0).revert(fault_id)
    except AgentRefused as exc:
        if exc.status in (404, 410):
            return f"agent {name} no longer held it: {exc.problem.error}"
        problem: InjectorError = exc
    except AgentUnreachable as exc:
        problem = exc
    else:
        return f"agent {name} (host {done.host}) reverted it"
    if isinstance(expires, int | float) and time.time() > expires:
        return (f"could not ask agent {name} ({problem}), but its lease ended at "
                f"{format_clock(expires)}, so the agent has reverted it on its own")
    ends = format_clock(float(expires)) if isinstance(expires, int | float) else "an unknown time"
    raise RevertError(f"{problem}; its lease ends at {ends}: the agent reverts it then; run "
                      "`streamquake recover` again after that")
