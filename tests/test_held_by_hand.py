"""A fault held by hand on this machine while a run runs (issue 34: the live view said
`faults: none` while one was on; issue 37: a foreign fault went unreported): the live view names
it, and the run warns, in its report too, that its effect is in the figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import assert_run_ended

FAMILY_ENV = {"STREAMQUAKE_FAULT_FAMILIES": "tests.example_family"}
SCENARIO = """
name: beside
target:
  protocol: openai
  embedded: {ttft: 30ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
load: {users: 2, think_time: {min: 50ms, max: 100ms}}
phases: {warmup: 1s, baseline: 8s, fault: 0s, recovery: 0s}
slos:
  - {metric: error_rate, max: 100%}
"""


@pytest.mark.timeout(180)
def test_a_fault_held_by_hand_is_named_live_and_in_the_report(tmp_path: Path,
                                                               state_dir: Path) -> None:
    flag = tmp_path / "flag"
    held = run_cli("inject", "marker_file", f"path={flag}", "--for", "2m", "--name", "by-me",
                   env=FAMILY_ENV)
    assert held.returncode == 0 and flag.exists(), held.stderr
    try:
        scenario = tmp_path / "s.yaml"
        scenario.write_text(SCENARIO)
        out = tmp_path / "out"
        proc = run_cli("run", str(scenario), "--out", str(out), env=FAMILY_ENV, timeout=150)
        assert_run_ended(proc)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("live: phase ")]
        assert lines and all("| faults: none; by hand: by-me (marker_file) |" in ln
                             for ln in lines), lines
        report = json.loads((out / "report.json").read_text())
        said = [e for e in report["errors"] if "fault 'by-me' (marker_file) was held by hand"
                in e]
        assert said and re.search(r"by \S+@\S+ \(inject, pid \d+\) \(not by this run\) in "
                                  r"(step \w+|the run's start-up): its effect is in this run's "
                                  r"figures", said[0]), report["errors"]
    finally:
        assert run_cli("revert", "by-me", env=FAMILY_ENV).returncode == 0
    assert not flag.exists()
