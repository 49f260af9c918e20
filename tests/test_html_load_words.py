"""How report.html names a step's load when the step has none of its own: the scenario's, in
its own terms (issue 34: an open loop at 10/s read "1 users (the scenario's)", its unused
default user count)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamquake.reports.html import _load_text
from streamquake.scenario import parse_scenario

BASE = """
name: t
target: {protocol: openai, embedded: {}}
phases: {baseline: 1s, fault: 0s, recovery: 0s}
"""


def _words(load_yaml: str, step_load: dict[str, object] | None = None) -> str:
    sc = parse_scenario(BASE + load_yaml)
    echo = sc.model_dump(mode="json", by_alias=True)
    return _load_text(SimpleNamespace(scenario_echo=echo),  # type: ignore[arg-type]
                      SimpleNamespace(load=step_load))      # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_the_scenarios_open_loop_is_its_rate() -> None:
    assert _words("load: {arrival: {rate: 10/s}}") == "10 req/s (the scenario's)"


@pytest.mark.timeout(10)
def test_the_scenarios_closed_loop_is_its_users_and_a_steps_own_load_is_its_own() -> None:
    assert _words("load: {users: 6}") == "6 users (the scenario's)"
    assert _words("load: {arrival: {rate: 10/s}}", {"rate": 20}) == "20 req/s"
