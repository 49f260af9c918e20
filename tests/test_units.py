"""Durations as people write them, compound ones included (``1m30s``, ``2h``, ``1h30m``), in
every duration field; the simple forms keep working."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.faults.tc.spec import NetemFault
from streamquake.units import (
    DurationMs,
    Fraction,
    Rate,
    Size,
    format_duration,
    parse_duration_ms,
    parse_duration_s,
)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "seconds"), [
    ("100ms", 0.1), ("1.5s", 1.5), ("3", 3.0), (3, 3.0), (2.5, 2.5), ("250us", 0.00025),
    ("2m", 120.0), ("2h", 7200.0), ("1m30s", 90.0), ("1h30m", 5400.0), ("1s500ms", 1.5),
    ("1h30m15.5s", 5415.5), (" 1m 30s ", 90.0), ("0s", 0.0),
])
def test_durations_in_seconds(text: str | float, seconds: float) -> None:
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "ms"), [
    ("100ms", 100.0), ("1.5s", 1500.0), ("400", 400.0), (400, 400.0), ("1m30s", 90_000.0),
    ("1s250ms", 1250.0),
])
def test_durations_in_milliseconds_keep_bare_numbers_as_ms(text: str | float, ms: float) -> None:
    assert parse_duration_ms(text) == pytest.approx(ms)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "message"), [
    ("10 sec", "expected a duration like '100ms' or '30s', got '10 sec'"),
    ("1m30", "expected a duration like '100ms' or '30s', got '1m30'"),
    ("30s1m", "write the units largest first, each once (e.g. '1h30m', '1m30s'), got '30s1m'"),
    ("1m1m", "write the units largest first, each once"),
    ("-1s", "expected a duration like '100ms' or '30s', got '-1s'"),
    (True, "expected a duration like '100ms' or '30s', got True"),
    (-2, "a duration cannot be negative, got -2"),
])
def test_bad_durations_say_what_to_write(text: str | float, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration_s(text)
    assert message in str(info.value)


@pytest.mark.timeout(10)
def test_every_duration_field_takes_compound_durations() -> None:
    from streamquake.scenario import parse_scenario

    scenario = parse_scenario("""\
name: compound
target:
  protocol: openai
  timeout: 1m30s
  embedded: {ttft: {dist: fixed, value: 1s200ms}}
load: {users: 1, think_time: {min: 1s, max: 1m1s}, stall_threshold: 1s250ms}
phases: {warmup: 1m, baseline: 2m30s, fault: 1h, recovery: 1h1m1s}
faults:
  - {type: netem, delay: 1s100ms}
  - {type: sse_proxy, name: p, stall: {probability: 1%, duration: 1m}}
agents:
  - {name: a1, url: "http://10.0.0.5:7355", lease: 1m30s}
""")
    assert scenario.target.timeout_s == 90.0
    assert scenario.phases.total_s == 60 + 150 + 3600 + 3661
    assert scenario.load.stall_threshold_ms == 1250.0
    assert scenario.load.think_time is not None and scenario.load.think_time.max_s == 61.0
    assert scenario.agents[0].lease_s == 90.0
    netem, proxy = scenario.faults
    assert isinstance(netem, NetemFault) and netem.delay_ms == 1100.0
    assert isinstance(proxy, SSEProxyFault) and proxy.stall is not None
    assert proxy.stall.duration_ms == 60_000.0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("seconds", "text"), [
    (0.25, "250ms"), (1.5, "1.5s"), (3, "3s"), (90, "1m30s"), (3600, "1h"), (5400, "1h30m"),
    (3725, "1h2m5s"),
])
def test_format_duration_writes_the_compound_form(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration_s(text) == pytest.approx(seconds, abs=0.05)


class _Declared(BaseModel):
    """Units declared by type only: no validator for the reference to read."""

    wait_ms: DurationMs = 0.0
    cap: Rate | None = Field(None, gt=0)
    share: Fraction = 0.5
    chunk: Size | None = None
    plain: float = 0.0


@pytest.mark.timeout(10)
def test_the_reference_reads_a_fields_unit_from_its_type() -> None:
    from streamquake.units import quantity

    m = _Declared.model_validate({"wait_ms": "1.5s", "cap": "8mbit", "share": "15%",
                                  "chunk": "32kb"})
    assert (m.wait_ms, m.cap, m.share, m.chunk) == (1500.0, 1e6, 0.15, 32768)
    assert [quantity(_Declared, f) for f in _Declared.model_fields] == [
        "duration", "rate", "percentage", "size", None]


@pytest.mark.timeout(30)
def test_the_schema_writes_a_bound_on_an_optional_quantity_as_json_schema() -> None:
    """Pydantic writes ``gt`` checked behind a before-validator under its Python name; an editor
    would not know it. The schema says ``exclusiveMinimum``, and takes the text form too."""
    from streamquake.scenario.docs import scenario_schema

    defs = scenario_schema()["$defs"]
    assert isinstance(defs, dict)
    rate = defs["NetemFault"]["properties"]["rate"]["anyOf"]
    assert rate[0] == {"exclusiveMinimum": 0, "type": "number"}
    assert rate[-1]["type"] == "string" and "8mbit" in rate[-1]["description"]
    buffer = defs["ReadSpec"]["properties"]["receive_buffer"]["anyOf"]
    assert buffer[0] == {"minimum": 1, "type": "integer"}


@pytest.mark.timeout(30)
def test_the_schema_bounds_a_phase_and_a_step_as_the_validator_does() -> None:
    """A phase, a step and a recovery window are checked by ``not_shorter_than`` (an after
    validator, invisible to JSON schema); the schema still tells an editor they cannot be
    negative, and a baseline, a step and a window not zero either."""
    from streamquake.scenario.docs import scenario_schema

    defs = scenario_schema()["$defs"]
    assert isinstance(defs, dict)

    def bound(model: str, field: str) -> dict[str, object]:
        number = defs[model]["properties"][field]["anyOf"][0]
        return {k: v for k, v in number.items() if k != "type"}

    assert [bound("PhasesSpec", f) for f in ("warmup", "fault", "recovery")] == [
        {"minimum": 0}] * 3
    assert bound("PhasesSpec", "baseline") == {"exclusiveMinimum": 0}
    assert bound("RecoverySpec", "window") == {"exclusiveMinimum": 0}
    assert bound("StepSpec", "duration") == {"exclusiveMinimum": 0}
