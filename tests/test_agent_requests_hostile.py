"""Issue 37, items 8 and 9: what a request sends cannot forge the agent's log or crash it.

An owner with a newline (or a terminal escape) is logged escaped, on its own line; a power limit
of 1e308 W is a 400 with a sentence, not a 500.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_agent import Agent, _marker, agents, call, start_agent, wait_logged

__all__ = ["agents"]     # the fixture, used by name below


@pytest.mark.timeout(60)
def test_an_owner_with_a_newline_is_logged_escaped(tmp_path: Path, agents: list[Agent]) -> None:
    agent = start_agent(tmp_path, "owner-log")
    agents.append(agent)
    flag = tmp_path / "flag"
    body = _marker(flag, owner="eve\n2026-01-01T00:00:00 agent: reverted everything\x1b[2J")
    status, held = call(agent.url, "POST", "/v1/faults", body)
    assert status == 201 and flag.exists(), held
    wait_logged(agent.log, "applied flag")
    lines = agent.text().splitlines()
    assert not any(ln.startswith("2026-01-01T00:00:00 agent:") for ln in lines), lines
    assert "\x1b" not in agent.text()
    applied = [ln for ln in lines if "applied flag" in ln]
    assert len(applied) == 1 and "eve\\n2026-01-01T00:00:00 agent: reverted everything" \
        "\\x1b[2J" in applied[0], applied


@pytest.mark.timeout(60)
@pytest.mark.parametrize("watts", [1e308, "1e308", 10**400])
def test_a_power_limit_past_any_gpu_is_a_400_with_a_sentence(
        tmp_path: Path, agents: list[Agent], watts: object) -> None:
    agent = start_agent(tmp_path, "power", "--allow-types", "gpu_clocks")
    agents.append(agent)
    status, body = call(agent.url, "POST", "/v1/faults",
                        {"fault": {"type": "gpu_clocks", "power_limit_w": watts}, "lease": 30,
                         "owner": "test"})
    assert status == 400, body
    assert "power_limit_w" in str(body["error"]), body
    assert "Traceback" not in agent.text()
