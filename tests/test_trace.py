"""Traces and prompt datasets as files a user would bring: Mooncake's JSONL, Azure's CSV, plain
rows; every problem names the file and line (and the scenario's own line for the field)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from streamquake.errors import ScenarioError
from streamquake.loadgen.trace import read_prompts, read_trace, synth_prompt
from streamquake.scenario import load_scenario

REPO = Path(__file__).resolve().parent.parent


def test_mooncake_rows_sorted_relative_and_sped_up(tmp_path: Path) -> None:
    path = tmp_path / "mc.jsonl"
    path.write_text(
        '{"timestamp": 5000, "input_length": 10, "output_length": 3, "hash_ids": [0]}\n'
        '\n'
        '{"timestamp": 2000, "input_length": 700, "output_length": 40, "hash_ids": [0, 1]}\n'
        '{"timestamp": 2000, "input_length": 8, "output_length": 1, "class": "short"}\n')
    rows = read_trace(path)
    assert [(r.offset_s, r.input_tokens, r.output_tokens) for r in rows] == [
        (0.0, 700, 40), (0.0, 8, 1), (3.0, 10, 3)]
    assert rows[1].cls == "short" and rows[2].line == 1
    assert [r.offset_s for r in read_trace(path, speedup=2)] == [0.0, 0.0, 1.5]


def test_azure_csv_with_seven_fraction_digits(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951840,396,109\n"
                    "2023-11-16 18:15:47.1805900,879,20\n")
    rows = read_trace(path)
    assert [r.input_tokens for r in rows] == [374, 879, 396]
    assert [round(r.offset_s, 6) for r in rows] == [0.0, 0.5, 4.314594]


def test_every_bad_row_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                    'not json\n'
                    '{"input_length": 5, "output_length": 2}\n'
                    '{"timestamp": 9, "input_length": 5.5, "output_length": 2}\n'
                    '{"timestamp": 9, "input_length": 5, "output_length": 0}\n'
                    '[1, 2]\n')
    with pytest.raises(ScenarioError) as err:
        read_trace(path)
    assert err.value.problems == [
        f"{path}:2: not JSON (Expecting value); write one JSON object per line",
        f"{path}:6: a row must be a JSON object, not list",
        f"{path}:3: no arrival time: give 'timestamp' (ms, Mooncake), 'TIMESTAMP' (Azure), "
        "'timestamp_ms' or 'arrival_s'",
        f"{path}:4: 'input_length' must be a whole number of tokens, not 5.5",
        f"{path}:5: output tokens 0: a streamed request asks for at least 1",
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ScenarioError, match="the trace has no rows"):
        read_trace(empty)


def test_prompt_datasets_jsonl_and_csv(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Summarise: a, b", "max_tokens": 12}) + "\n"
                     + json.dumps({"prompt": "Hi"}) + "\n")
    assert [(r.prompt, r.max_tokens) for r in read_prompts(jsonl)] == [
        ("Summarise: a, b", 12), ("Hi", None)]
    csv = tmp_path / "p.csv"
    csv.write_text('prompt,max_tokens\n"Say ""hi"", then stop",5\nTell a story,\n')
    assert [(r.prompt, r.max_tokens) for r in read_prompts(csv)] == [
        ('Say "hi", then stop', 5), ("Tell a story", None)]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ScenarioError, match=r"b.jsonl:1: 'prompt' must be a non-empty string"):
        read_prompts(bad)


def test_synthesised_prompts_have_the_rows_length_and_repeat() -> None:
    a = synth_prompt(300, random.Random(1))
    assert len(a.split()) == 300 and a == synth_prompt(300, random.Random(1))


def test_a_scenario_names_its_own_line_and_the_traces(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"timestamp": 0, "input_length": 1, "output_length": x}\n')
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: t\ntarget: {protocol: openai, embedded: {}}\nload:\n"
                        "  trace: t.jsonl\nphases: {baseline: 1s, fault: 0s, recovery: 0s}\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario)
    (problem,) = err.value.problems
    assert problem.startswith(f"{scenario}:4:10: load.trace: {tmp_path / 't.jsonl'}:1: not JSON")
    mixed = tmp_path / "m.yaml"
    mixed.write_text("name: t\ntarget: {protocol: openai, embedded: {}}\nload:\n"
                     "  trace: t.jsonl\n  arrival: {rate: 5/s}\n"
                     "phases: {baseline: 1s, fault: 0s, recovery: 0s}\n")
    with pytest.raises(ScenarioError, match="a 'trace' sets its own arrival times"):
        load_scenario(mixed)


def test_the_shipped_synthetic_trace_and_its_scenario_load() -> None:
    rows = read_trace(REPO / "scenarios" / "traces" / "synthetic-mooncake.jsonl")
    assert len(rows) == 418 and rows[-1].offset_s < 60
    scenario = load_scenario(REPO / "scenarios" / "trace-replay.yaml")
    assert scenario.load.trace is not None
    assert Path(scenario.load.trace.file).is_absolute()
