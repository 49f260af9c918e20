"""The scenario reaches the load process's plan: retries and the stream limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamquake.errors import ScenarioError
from streamquake.loadgen.plan import LoadPlan, TraceReplay
from streamquake.run.load_from_scenario import load_plan_for
from streamquake.scenario import parse_scenario


@pytest.mark.timeout(10)
def test_limits_and_retries_travel_to_the_load_plan(tmp_path: Path) -> None:
    sc = parse_scenario("name: x\ntarget: {protocol: openai, embedded: {}}\n"
                        "load: {retries: standard, limits: {line: 64kb, event: 1mb, "
                        "data_lines: 1000}}\nphases: {baseline: 1s, fault: 0s, recovery: 0s}\n")
    plan = load_plan_for(sc, "http://127.0.0.1:1", tmp_path, end_at=0.0)
    assert (plan.retries, plan.max_line_bytes, plan.max_event_bytes, plan.max_data_lines) == \
        ("standard", 64 * 1024, 1 << 20, 1000)
    default = load_plan_for(parse_scenario(
        "name: x\ntarget: {protocol: openai, embedded: {}}\n"
        "phases: {baseline: 1s, fault: 0s, recovery: 0s}\n"), "http://127.0.0.1:1", tmp_path, 0.0)
    assert (default.retries, default.max_line_bytes) == ("none", 1 << 20)
    with pytest.raises(ScenarioError, match="load.limits.line"):
        parse_scenario("name: x\ntarget: {protocol: openai, embedded: {}}\n"
                       "load: {limits: {line: 10}}\nphases: {baseline: 1s, fault: 0s, "
                       "recovery: 0s}\n")


@pytest.mark.timeout(10)
def test_trace_rows_are_split_over_local_and_remote_workers(tmp_path: Path) -> None:
    """Row i goes to the process whose worker index is i mod processes: every Locust worker,
    here or elsewhere, counts, or remote workers would each replay every row."""
    trace = Path("scenarios/traces/synthetic-mooncake.jsonl").resolve()
    for workers, remote, processes in ((0, 0, 1), (2, 0, 2), (0, 3, 3), (1, 2, 3)):
        plan = _trace_plan(tmp_path, f"trace: {trace}, workers: {workers}, remote_workers: "
                           f"{remote}, master_bind: '0.0.0.0:5557'")
        assert isinstance(plan.arrival, TraceReplay)
        assert (plan.arrival.processes, plan.users) == (processes, processes)


@pytest.mark.timeout(10)
def test_a_rows_tenant_picks_the_class_of_that_name(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "tenant": "acme"}\n'
        '{"timestamp": 10, "input_length": 10, "output_length": 5, "tenant": "other"}\n'
        '{"timestamp": 20, "input_length": 10, "output_length": 5, "tenant": "acme", '
        '"class": "bulk"}\n'
        '{"timestamp": 30, "input_length": 10, "output_length": 5}\n')
    plan = _trace_plan(tmp_path, f"trace: {trace}, classes: [{{name: acme}}, {{name: bulk}}]")
    assert isinstance(plan.arrival, TraceReplay)
    assert [row[3] for row in plan.arrival.rows] == ["acme", None, "bulk", None]


def _trace_plan(tmp_path: Path, load: str) -> LoadPlan:
    """The load plan of a 60 s scenario with these ``load:`` fields (a trace among them)."""
    sc = parse_scenario(f"name: x\ntarget: {{protocol: openai, embedded: {{}}}}\n"
                        f"load: {{{load}}}\nphases: {{baseline: 60s, fault: 0s, recovery: 0s}}\n")
    return load_plan_for(sc, "http://10.0.0.1:1", tmp_path, end_at=100.0)
