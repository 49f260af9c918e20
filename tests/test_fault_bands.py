"""Fault windows on report.html's charts: each fault of a run in its own colour, its label on
its own line, a flapping fault named once per chart (its later windows on hover), so two
flapping faults neither share a colour nor overprint their labels (issue 34). A real run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamquake.reports import svg
from tests.conftest import run_cli
from tests.helpers import assert_run_ok

SCENARIO = """
name: two-flaps
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 2ms, output_tokens: {min: 10, max: 10}, seed: 3}
  timeout: 10s
load: {users: 2, think_time: {min: 20ms, max: 50ms}, seed: 3}
phases: {baseline: 2s, fault: 6s, recovery: 1s}
faults:
  - {type: sse_proxy, name: slow, phase: fault, first_event_delay: 50ms, flap: {on: 1s, off: 1s}}
  - {type: sse_proxy, name: lossy, phase: fault, drop: 10%, flap: {on: 2s, off: 1s}}
"""


@pytest.mark.timeout(150)
def test_two_flapping_faults_each_in_its_colour_labelled_once_per_chart(
        tmp_path: Path, state_dir: Path) -> None:
    scenario = tmp_path / "two.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), "--no-watchdog", timeout=120)
    assert_run_ok(proc, out)
    html = (out / "report.html").read_text()
    charts = re.findall(r'<svg class="chart" data-chart="[^"]+".*?</svg>', html, re.S)
    banded = [c for c in charts if "<title>slow on</title>" in c]
    assert banded, "no chart shows the fault windows"
    for chart in banded:
        rects = {name: re.findall(r'<rect class="band" style="fill:(#[0-9a-f]{6})"[^>]*>'
                                  rf"<title>{name} on</title>", chart)
                 for name in ("slow", "lossy")}
        # Every on-window drawn (slow flapped on 3 times in 6 s, lossy twice), in one colour
        # each, and the two colours differ.
        assert len(rects["slow"]) >= 2 and len(rects["lossy"]) >= 2, rects
        assert all(len(set(v)) == 1 for v in rects.values()), rects
        assert rects["slow"][0] != rects["lossy"][0]
        assert {rects["slow"][0], rects["lossy"][0]} <= set(svg.FAULT_COLORS)
        # Each named once on the chart, on lines of their own.
        labels = re.findall(r'<text class="bl"[^>]* y="([0-9.]+)">(\w+) on</text>', chart)
        assert sorted(name for _, name in labels) == ["lossy", "slow"], labels
        assert len({y for y, _ in labels}) == 2, labels
