"""A recorded trace replayed for real (CLI, embedded target, Locust): every row due in the run is
either sent at its own time (the wait before the send is its dispatch delay) or recorded as not
sent, and each request carries its row's output length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import assert_run_ok

SCENARIO = """
name: replay
target:
  protocol: openai
  embedded: {{ttft: 300ms, itl: 5ms, output_tokens: {{min: 100, max: 100}}}}
  timeout: 10s
load:
  trace: {{file: trace.jsonl, speedup: {speedup}, max_inflight: 2}}
  classes: [{{name: default}}, {{name: vip}}]
phases: {{warmup: 0.5s, baseline: 3s, fault: 0s, recovery: 0s}}
slos: [{{metric: not_sent_rate, max: 100%}}]
"""


def _trace(path: Path) -> list[dict[str, object]]:
    # Sparse at first (one every 400 ms, each done long before the next), then a burst of 24
    # rows 40 ms apart that two slots of 300 ms streams cannot keep up with before the end.
    rows: list[dict[str, object]] = [
        {"timestamp": 800 * i, "input_length": 30 + i, "output_length": 3 + i} for i in range(5)]
    rows += [{"timestamp": 4000 + 80 * i, "input_length": 10, "output_length": 2}
             for i in range(24)]
    rows[2]["class"] = "vip"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))  # any order
    return rows


def _lines(directory: Path, prefix: str) -> list[dict[str, object]]:
    out = []
    for path in directory.glob(f"{prefix}-*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


@pytest.mark.timeout(120)
def test_every_row_is_sent_at_its_time_or_counted_as_not_sent(tmp_path: Path) -> None:
    rows = _trace(tmp_path / "trace.jsonl")
    speedup = 2.0
    scenario = tmp_path / "replay.yaml"
    scenario.write_text(SCENARIO.format(speedup=speedup))
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out))
    assert_run_ok(proc, out)

    plan = json.loads((out / "run" / "load-plan.json").read_text())
    start, end = plan["arrival"]["start_at"], plan["end_at"]
    at = {round(start + int(str(r["timestamp"])) / 1000 / speedup, 6): r for r in rows}
    due = {t: r for t, r in at.items() if t < end}
    samples = [s for s in _lines(out / "run" / "samples", "samples") if not s["retried"]]
    unsent = _lines(out / "run" / "samples", "unsent")
    assert len(due) == len(rows) == 29, "at 2x speed the whole trace is due within 3.5 s"
    assert len(samples) + len(unsent) == len(due)          # every row accounted for, once
    assert unsent, "the burst outran two slots: some rows were never sent"

    scheduled = [round(s["scheduled"], 6) for s in samples] + \
        [round(u["scheduled"], 6) for u in unsent]
    assert sorted(scheduled) == sorted(due)                 # each row at its own time
    for s in samples:
        row = due[round(s["scheduled"], 6)]
        # Sent at its time, give or take its dispatch delay (which the report shows).
        assert 0 <= s["sent"] - s["scheduled"] < 5.0
        assert s["content_events"] == row["output_length"], (s, row)
        assert s["cls"] == row.get("class", s["cls"])
        if row.get("class") is None:
            assert s["cls"] in ("default", "vip")
    sparse = [s for s in samples if due[round(s["scheduled"], 6)]["timestamp"] < 4000]
    assert len(sparse) == 5 and max(s["sent"] - s["scheduled"] for s in sparse) < 0.25
    assert {s["cls"] for s in sparse if due[round(s["scheduled"], 6)].get("class")} == {"vip"}

    report = json.loads((out / "report.json").read_text())
    phases = {p["name"]: p["stats"] for p in report["phases"]}
    assert sum(p["sent"] for p in phases.values()) == len(samples)
    assert sum(p["not_sent"] for p in phases.values()) == len(unsent)
    assert "arrivals not sent" in proc.stdout


@pytest.mark.timeout(120)
def test_a_prompt_dataset_gives_each_request_its_rows_max_tokens(tmp_path: Path) -> None:
    (tmp_path / "prompts.csv").write_text('prompt,max_tokens\n"Say ""a"".",3\nSay b.,5\n'
                                          "Say c.,\n")
    scenario = tmp_path / "ds.yaml"
    scenario.write_text(
        "name: ds\ntarget: {protocol: anthropic, embedded: {ttft: 5ms, itl: 1ms, "
        "output_tokens: {min: 100, max: 100}}}\nload: {users: 2, think_time: {min: 10ms, max: "
        "20ms}, classes: [{name: d, dataset: prompts.csv, max_tokens: 7}]}\n"
        "phases: {warmup: 0.5s, baseline: 2s, fault: 0s, recovery: 0s}\n")
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out))
    assert_run_ok(proc, out)
    samples = _lines(out / "run" / "samples", "samples")
    lengths = {s["content_events"] for s in samples}
    # 3 and 5 from their rows; 7, the class's own, for the row that gives none.
    assert lengths == {3, 5, 7} and len(samples) > 20, (lengths, len(samples))
