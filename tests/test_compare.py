"""`streamquake compare` on real runs: a run against a rerun of the same scenario says "same"
(exit 0), with A's figures and counts those of A's own report (one attribution rule) and the
scenario's slack as the latency floor; against a run whose target's TTFT was raised from 80 to
320 ms (a different scenario file: refused unless --different-scenarios, then said) it says
"worse" on TTFT with an interval that excludes zero (exit 1); Markdown and JSON come out; a
report.json on its own (no samples) is compared by point estimates and says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.report_runs import Runs, report_runs


@pytest.fixture(scope="module")
def runs() -> Runs:
    return report_runs()


@pytest.mark.timeout(240)
def test_two_runs_of_the_same_scenario_are_the_same(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "same.json"
    proc = run_cli("compare", str(runs["a"].out), str(runs["a2"].out), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["regression"] is False and "bootstrap" in result["method"]
    rows = result["rows"]
    assert {r["phase"] for r in rows} == {"baseline", "fault", "recovery"}
    assert [r for r in rows if r["verdict"] in ("worse", "better")] == []
    # The intervals are real: they bracket the point difference and the zero line.
    ttft = [r for r in rows if r["metric"] == "ttft_ms" and r["percentile"] == 50]
    for r in ttft:
        assert r["ci_low"] <= r["diff"] <= r["ci_high"]
        assert r["ci_low"] <= 0 <= r["ci_high"], r
        assert r["n_a"] > 10 and r["n_b"] > 10


@pytest.mark.timeout(240)
def test_a_known_injected_regression_is_worse_and_exits_1(runs: Runs, tmp_path: Path) -> None:
    md, js = tmp_path / "cmp.md", tmp_path / "cmp.json"
    proc = run_cli("compare", str(runs["a"].out / "report.json"), str(runs["b"].out),
                   "--markdown", str(md), "--json", str(js), "--different-scenarios")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REGRESSION" in proc.stdout
    assert "different definitions of scenario 'quick'" in proc.stdout
    rows = {(r["phase"], r["metric"], r["percentile"]): r
            for r in json.loads(js.read_text())["rows"]}
    for phase in ("baseline", "recovery"):
        r = rows[(phase, "ttft_ms", 50)]
        assert r["verdict"] == "worse" and r["sure"] is True
        assert 200 < r["diff"] < 280, r                     # 320 - 80 ms medians
        assert r["ci_low"] > r["margin"] > 0                 # the whole interval past it
    # Inter-token latency was not touched: never called worse.
    assert rows[("baseline", "itl_ms", 50)]["verdict"] == "same"
    text = md.read_text()
    assert text.startswith("## streamquake compare: worse")
    assert "| ttft_ms p50 |" in text and "**worse ❌**" in text and "95% CI" in text
    assert "different definitions of scenario 'quick'" in text


@pytest.mark.timeout(120)
def test_runs_of_different_scenarios_are_refused(runs: Runs) -> None:
    proc = run_cli("compare", str(runs["a"].out), str(runs["b"].out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different definitions of scenario 'quick'" in lines[0], lines
    assert "--different-scenarios" in lines[0] and proc.stdout == ""


@pytest.mark.timeout(240)
def test_figures_are_the_reports_own(runs: Runs, tmp_path: Path) -> None:
    # One attribution rule: each measurement counts where the run counted it (a TTFT whose
    # request ended after the phase, an inter-token gap in the phase it happened in), so A's
    # counts are its report's, and its values the report's up to the HDR histograms' 4 digits.
    out = tmp_path / "same.json"
    proc = run_cli("compare", str(runs["a"].out), str(runs["a2"].out), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    report = json.loads((runs["a"].out / "report.json").read_text())
    stats = {p["name"]: p["stats"] for p in report["phases"]}
    for r in result["rows"]:
        s = stats[r["phase"]]
        if r["percentile"] is None:
            assert r["n_a"] == s["requests"] and r["a"] == pytest.approx(s[r["metric"]]), r
        else:
            summary = s[r["metric"]]
            assert r["n_a"] == summary["count"], (r, summary)
            assert r["a"] == pytest.approx(summary[f"p{r['percentile']:g}"], rel=1e-3), r
    # The scenario's recovery.slack (20 ms) is the floor for latencies, as in `history`.
    assert result["slack_ms"] == 20
    assert all(r["margin"] >= 20 for r in result["rows"] if r["metric"].endswith("_ms"))


@pytest.mark.timeout(120)
def test_a_report_without_samples_is_compared_by_point_estimates(runs: Runs,
                                                                 tmp_path: Path) -> None:
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(runs["b"].out / "report.json", lone / "report.json")
    proc = run_cli("compare", str(runs["a"].out), str(lone), "--json", str(tmp_path / "c.json"),
                   "--different-scenarios")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "c.json").read_text())
    assert "no confidence interval" in result["method"]
    assert all(r["ci_low"] is None for r in result["rows"])


@pytest.mark.timeout(60)
def test_unreadable_inputs_are_usage_errors(tmp_path: Path) -> None:
    proc = run_cli("compare", str(tmp_path / "nope"), str(tmp_path / "nope2"))
    assert proc.returncode == 2 and "cannot read the report" in proc.stderr
    (tmp_path / "x.json").write_text("{}")
    proc = run_cli("compare", str(tmp_path / "x.json"), str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "not a streamquake report" in proc.stderr
    proc = run_cli("compare", str(tmp_path), str(tmp_path), "--tolerance", "lots")
    assert proc.returncode == 2
