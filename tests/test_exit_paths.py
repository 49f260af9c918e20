"""Every exit means one thing (issue 20, items 8 and 9): inputs that once ended in a traceback
and exit 1 ("an SLO broke") now end in one sentence and the documented code, with reports
written where they can be; names that would corrupt a report or a terminal are refused; a
header that Locust would refuse is refused before anything starts; failures that ended after
their phase are shown, not only counted in samples.csv."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from streamquake.loadgen.samples import RequestSample
from streamquake.reports.table import error_rows, summary_rows
from streamquake.result import PhaseResult, RunResult
from streamquake.run.scoring import score_samples
from streamquake.run.timeline import PhaseWindow
from streamquake.scenario import parse_scenario
from tests.conftest import REPO, run_cli

QUICK = (REPO / "scenarios" / "quickstart.yaml").read_text()


def _no_traceback(proc: object) -> str:
    text = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in text, text
    return text


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("old", "new", "says"), [
    ("recovery: {tolerance: 10%", "recovery: {tolerance: null", "recovery.tolerance"),
    ("recovery: {tolerance: 10%", "recovery: {tolerance: [1]", "recovery.tolerance"),
    ("recovery: {tolerance: 10%", "recovery: {tolerance: {a: 1}", "recovery.tolerance"),
    ("users: 20", "users: true", "load.users"),
    ("spawn_rate: 20", "spawn_rate: false", "load.spawn_rate"),
    ("name: quickstart", 'name: "quick\\0start"', "U+0000"),
    ("name: chunk-drop", 'name: "chunk\\u202Edrop"', "U+202E"),
    ("name: chunk-drop", 'name: "chunk\\adrop"', "U+0007"),
    ("name: chat", 'name: "ch\\ud800at"', "U+D800"),
    ("model: sim-1", 'model: "sim\\udc00"', "U+DC00"),
])
def test_a_wrong_value_is_one_located_sentence_and_exit_2(tmp_path: Path, old: str, new: str,
                                                           says: str) -> None:
    assert old in QUICK
    scenario = tmp_path / "s.yaml"
    scenario.write_text(QUICK.replace(old, new, 1))
    for command in (("validate",), ("run", "--dry-run"), ("run", "--out", str(tmp_path / "o"))):
        proc = run_cli(*command[:1], str(scenario), *command[1:])
        text = _no_traceback(proc)
        assert proc.returncode == 2, (command, text)
        assert f"{scenario}:" in text and says in text, text


@pytest.mark.timeout(120)
def test_a_path_that_is_not_utf8_is_echoed_escaped_not_a_traceback(tmp_path: Path) -> None:
    odd = os.fsdecode(bytes(tmp_path) + b"/scen\xff.yaml")     # a surrogate, as argv gives it
    out = tmp_path / "out"
    for args in (("run", odd, "--out", str(out)), ("validate", odd)):
        proc = run_cli(*args)
        text = _no_traceback(proc)
        assert proc.returncode == 2, text
        assert "scen\\udcff.yaml" in text or "scen\\xff.yaml" in text, text
    assert not out.exists()      # a scenario that cannot be read writes nothing
    # ... and one that can be read, under such a name, gets its reports written.
    real = bytes(tmp_path) + b"/bad\xff.yaml"
    with open(real, "w") as f:
        f.write("name: bad\nnot: valid\n")
    proc = run_cli("run", os.fsdecode(real), "--out", str(out))
    text = _no_traceback(proc)
    assert proc.returncode == 2, text
    assert "bad\\udcff.yaml" in (out / "summary.md").read_text()


@pytest.mark.timeout(120)
def test_an_output_place_or_state_directory_under_a_file_is_one_sentence_and_exit_3(
        tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = run_cli("run", "scenarios/quickstart.yaml", "--out", str(afile / "out"))
    text = _no_traceback(proc)
    assert proc.returncode == 3, text
    assert f"cannot write the reports to --out {afile / 'out'}: Not a directory" in text
    env = {"STREAMQUAKE_STATE_DIR": str(afile / "state")}
    for args in (("recover",), ("run", "scenarios/quickstart.yaml", "--out",
                                str(tmp_path / "o"))):
        proc = run_cli(*args, env=env)
        text = _no_traceback(proc)
        assert proc.returncode == 3, (args, text)
        assert f"cannot use the state directory {afile / 'state'}: Not a directory" in text
    assert (tmp_path / "o" / "junit.xml").exists()       # the run's reports, still written


@pytest.mark.timeout(120)
def test_a_line_break_in_an_expanded_header_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(QUICK.replace("  timeout: 20s", '  timeout: 20s\n  headers: '
                                      '{X-Key: "${SQ_TEST_VALUE}"}', 1))
    started = time.monotonic()
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "o"),
                   env={"SQ_TEST_VALUE": "a\r\nInjected: 1"})
    text = _no_traceback(proc)
    assert proc.returncode == 3, text
    assert "header 'X-Key' holds a line break" in text and "${SQ_TEST_VALUE}" in text
    assert "Injected" not in text                     # the value itself is never echoed
    assert time.monotonic() - started < 60            # hang-only: the 55 s run never began
    assert not (tmp_path / "o" / "run" / "locust.log").exists()


def test_requests_that_failed_after_their_phase_are_its_errors_and_shown_so() -> None:
    scenario = parse_scenario(QUICK, "q.yaml")
    now = time.time()
    windows = [PhaseWindow("baseline", now, now + 5)]
    # Sent in the baseline, timed out 20 s later, after the phase: the phase's errors all the
    # same (every request is judged in the step it was due in), cut off before any token.
    late = [RequestSample(cls="chat", sent=now + 1, e2e_ms=20_000.0, error="timeout",
                          error_detail="no complete stream within 20 s") for _ in range(6)]
    ok = RequestSample(cls="chat", sent=now + 1, ttft_ms=100.0, e2e_ms=500.0)
    scored = score_samples(scenario, windows, [*late, ok])
    stats = scored.stats["baseline"]
    assert stats.errors["timeout"] == 6 and stats.value("error_rate") == pytest.approx(6 / 7)
    assert stats.ended_after["e2e_ms"] == 6 and stats.censored_count("ttft_ms") == 6
    result = RunResult(scenario_name="q", scenario_file="q.yaml", scenario_echo={},
                       tool_version="t", started_at=now, finished_at=now + 5, interrupted=None,
                       phases=[PhaseResult(name="baseline", start=now, end=now + 5,
                                           stats=stats.to_dict())],
                       checks=[], faults=[], target={})
    rows = dict(error_rows(result))
    assert rows["timeout"]["baseline"] == "6" and "timeout, ended after its phase" not in rows
    summary = dict(summary_rows(result))
    assert summary["ended after its step: TTFT/end"]["baseline"] == "0/6"
    assert summary["cut off by the timeout: TTFT/end"]["baseline"] == "6/6"
    # Six of seven TTFTs are known only as at least 20 s: the p95 is a lower bound, shown so.
    p95 = summary["TTFT p95 ms"]["baseline"]
    assert p95.startswith("≥") and float(p95[1:]) == pytest.approx(20_000.0, rel=1e-3)
