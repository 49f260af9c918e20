"""Scenario validation: every bad fixture gives its exact message, all problems at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamquake.errors import ScenarioError
from streamquake.scenario import load_scenario, parse_scenario
from tests.conftest import REPO, run_cli

BAD = Path("tests/scenarios/bad")

EXPECTED = {
    "unknown_field.yaml": [
        "6:3: load.userz: unknown field (hint: did you mean 'users'? allowed here: arrival, "
        "classes, seed, spawn_rate, stall_threshold, think_time, users, workers)"
    ],
    "missing_phases.yaml": ["1:1: phases: required field is missing (hint: add 'phases:' here)"],
    "bad_duration.yaml": [
        "6:3: phases.baseline: expected a duration like '100ms' or '30s', got '10 sec'"
    ],
    "unknown_fault_type.yaml": [
        "7:5: faults.0: Input tag 'chaos_monkey' found using 'type' does not match any of the "
        "expected tags: 'gpu_clocks', 'netem', 'sse_proxy', 'tbf' (hint: use one of the values "
        "listed)"
    ],
    "percentile_missing.yaml": [
        "7:5: slos.0: 'ttft_ms' is a distribution: add 'percentile', e.g. 95"
    ],
    "two_targets.yaml": [
        "2:1: target: give exactly one of 'url' (a running endpoint) or 'embedded' (the "
        "simulated server, e.g. 'embedded: {}')"
    ],
    "not_yaml.yaml": ["3:1: not valid YAML: expected ',' or '}', but got '<scalar>'"],
    "proxy_drop_over_100.yaml": ["9:5: faults.0.drop: must be between 0% and 100%, got '150%'"],
    "many_problems.yaml": [
        "3:3: target.protocol: Input should be 'gemini', 'openai', 'anthropic' or 'sse' "
        "(hint: use one of the values listed)",
        "5:5: target.embedded.ttft: Input tag 'gamma' found using 'dist' does not match any of "
        "the expected tags: 'fixed', 'normal', 'lognormal' (hint: use one of the values listed)",
        "7:3: load.users: Input should be greater than or equal to 1 (hint: use a bigger value)",
        "15:5: faults.0.drop: must be between 0% and 100%, got '150%'",
        "17:6: slos.0.metric: Input should be 'ttfb_ms', 'ttft_ms', 'itl_ms', 'e2e_ms', "
        "'output_tokens_per_s', 'error_rate', 'stall_rate' or 'chunk_loss' (hint: use one of "
        "the values listed)",
    ],
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_bad_fixture_gives_exact_messages(fixture: str) -> None:
    path = BAD / fixture
    with pytest.raises(ScenarioError) as info:
        load_scenario(REPO / path)
    got = [p.removeprefix(f"{REPO / path}:") for p in info.value.problems]
    assert got == EXPECTED[fixture]


def test_every_bad_fixture_is_covered() -> None:
    assert {p.name for p in (REPO / BAD).glob("*.yaml")} == set(EXPECTED)


@pytest.mark.timeout(30)
def test_validate_cli_prints_file_line_and_exits_2() -> None:
    proc = run_cli("validate", str(BAD / "many_problems.yaml"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 5
    assert lines[0].startswith(f"Error: {BAD / 'many_problems.yaml'}:3:3: target.protocol:")
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "scenarios").glob("*.yaml")))
def test_shipped_scenarios_validate(path: str) -> None:
    proc = run_cli("validate", f"scenarios/{path}")
    assert proc.returncode == 0, proc.stderr
    assert ": OK: scenario" in proc.stdout


def test_missing_file_is_a_scenario_error() -> None:
    with pytest.raises(ScenarioError, match="cannot read the scenario file"):
        load_scenario("/nonexistent/scenario.yaml")


def test_units_and_defaults() -> None:
    sc = parse_scenario(
        """
name: units
target: {protocol: sse, url: "http://127.0.0.1:9/", headers: {X-Key: "${MY_KEY}"}, timeout: 1.5s}
load: {users: 3, arrival: {rate: 600/m}, stall_threshold: 0.5s}
phases: {baseline: 1m, fault: 500ms, recovery: 2}
slos: [{metric: chunk_loss, max: 2%}, {metric: e2e_ms, percentile: 99.9, max: 2s}]
"""
    )
    assert sc.target.url == "http://127.0.0.1:9"
    assert sc.target.timeout_s == 1.5
    assert sc.load.arrival is not None and sc.load.arrival.rate_per_s == 10.0
    assert sc.load.stall_threshold_ms == 500.0
    assert (sc.phases.baseline_s, sc.phases.fault_s, sc.phases.recovery_s) == (60.0, 0.5, 2.0)
    assert sc.slos[0].max == 0.02 and sc.slos[1].max == 2000.0
    assert sc.slos[0].phases == ["baseline", "fault", "recovery"]


@pytest.mark.parametrize(
    ("snippet", "complaint"),
    [
        ('headers: {A: "${1BAD}"}', "is not an environment variable name"),
        ("url: ftp://x", "must start with http:// or https://"),
    ],
)
def test_target_field_checks(snippet: str, complaint: str) -> None:
    text = f"""
name: t
target: {{protocol: openai, {snippet if snippet.startswith('url') else 'embedded: {}, ' + snippet}}}
phases: {{baseline: 1s, fault: 0s, recovery: 0s}}
"""
    with pytest.raises(ScenarioError, match=complaint):
        parse_scenario(text)


def test_fault_in_an_empty_phase_is_rejected() -> None:
    with pytest.raises(ScenarioError, match="lasts 0 s"):
        parse_scenario(
            """
name: t
target: {protocol: openai, embedded: {}}
phases: {baseline: 1s, fault: 0s, recovery: 1s}
faults: [{type: sse_proxy, drop: 10%}]
"""
        )
