"""`streamquake compare` on real runs.

One run a side (``report_runs``: ``a``, ``a2`` the same scenario, ``b`` its target's TTFT raised
from 80 to 320 ms): the table of B - A with bootstrap intervals over the requests, A's figures
and counts those of A's own report, but no verdict that gates (exit 0, "not enough runs") unless
``--min-runs 1``, which then says "worse" on TTFT for the injected regression. Several runs a
side (``repeat_runs``: four identical runs, two with the TTFT doubled, one with its load
generator frozen on purpose): identical runs are not flagged, the real regression is (exit 1),
and a phase whose load generator was saturated is not judged, however slow its timings read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.repeat_runs import Repeat, repeat_runs
from tests.report_runs import Runs, report_runs


@pytest.fixture(scope="module")
def runs() -> Runs:
    return report_runs()


@pytest.fixture(scope="module")
def repeat() -> Repeat:
    return repeat_runs()


def _saturated(out: Path) -> set[str]:
    report = json.loads((out / "report.json").read_text())
    return {p["name"] for p in report["phases"] if p["stats"].get("client_saturated") is True}


def _rows(path: Path) -> dict[tuple[str, str, float | None], dict]:
    return {(r["phase"], r["metric"], r["percentile"]): r
            for r in json.loads(path.read_text())["rows"]}


@pytest.mark.timeout(240)
def test_one_run_a_side_is_shown_but_not_judged(runs: Runs, tmp_path: Path) -> None:
    # Two runs of one scenario: what they differ by within their requests is shown, but one
    # run a side cannot tell a change from the variation between runs: no gate (exit 0).
    out = tmp_path / "same.json"
    proc = run_cli("compare", str(runs["a"].out), str(runs["a2"].out), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["regression"] is False and "bootstrap" in result["method"]
    assert result["between_runs"] is False
    assert result["not_judged"].startswith("not enough runs (1 of 3 runs of A)"), result
    assert "not judged: not enough runs (1 of 3 runs of A)" in " ".join(proc.stdout.split())
    rows = result["rows"]
    assert {r["phase"] for r in rows} == {"baseline", "fault", "recovery"}
    # The intervals are real: they bracket the point difference.
    for r in rows:
        if r["metric"] == "ttft_ms" and r["percentile"] == 50 and r["ci_low"] is not None:
            assert r["ci_low"] <= r["diff"] <= r["ci_high"], r
            assert r["n_a"] > 0 and r["n_b"] > 0


@pytest.mark.timeout(240)
def test_a_known_injected_regression_is_worse_with_min_runs_1(runs: Runs,
                                                              tmp_path: Path) -> None:
    # --min-runs 1 gates on one run a side, by the requests within the two runs.
    md, js = tmp_path / "cmp.md", tmp_path / "cmp.json"
    proc = run_cli("compare", str(runs["a"].out / "report.json"), str(runs["b"].out),
                   "--markdown", str(md), "--json", str(js), "--different-scenarios",
                   "--min-runs", "1")
    assert "different definitions of scenario 'quick'" in proc.stdout
    rows = _rows(js)
    distorted = _saturated(runs["a"].out) | _saturated(runs["b"].out)
    judged = []
    for phase in ("baseline", "recovery"):
        r = rows[(phase, "ttft_ms", 50)]
        if phase in distorted:                              # a busy machine: said, not judged
            assert r["verdict"] == "not judged" and "saturated" in r["why"], r
            continue
        if r["diff"] is None:                   # a load that started late: no TTFT there
            assert r["verdict"] == "no data", r
            continue
        judged.append(phase)
        assert 200 < r["diff"] < 280, r                     # 320 - 80 ms medians
        assert r["verdict"] == "worse" and r["sure"] is True
        assert r["ci_low"] > r["margin"] > 0                 # the whole interval past it
    result = json.loads(js.read_text())
    assert proc.returncode == (1 if result["regression"] else 0), proc.stdout + proc.stderr
    # Inter-token latency was not touched: never called worse.
    assert rows[("baseline", "itl_ms", 50)]["verdict"] in ("same", "not judged")
    text = md.read_text()
    assert "| ttft_ms p50 |" in text and "95% CI" in text
    assert "different definitions of scenario 'quick'" in text
    if judged:
        assert "REGRESSION" in proc.stdout
        assert text.startswith("## streamquake compare: worse") and "**worse ❌**" in text


@pytest.mark.timeout(600)
def test_identical_runs_are_not_flagged(repeat: Repeat, tmp_path: Path) -> None:
    # Four runs of one scenario, three against the fourth and two against two: judged by the
    # variation between them (no interval over requests), and none called worse.
    for args in ([repeat["a1"], repeat["a2"], repeat["a3"], "--", repeat["a4"]],
                 [repeat["a1"], repeat["a2"], "--", repeat["a3"], repeat["a4"], "--min-runs",
                  "2"]):
        js = tmp_path / "same.json"
        proc = run_cli("compare", *map(str, args), "--json", str(js))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads(js.read_text())
        assert result["between_runs"] is True and result["regression"] is False
        assert "variation between runs" in result["method"]
        assert [r for r in result["rows"] if r["verdict"] == "worse"] == [], result["rows"]
        assert "no regression" in proc.stdout
        # A figure is judged where the load generator kept up and the runs had the values to
        # bound it; else the row says why not (a busy machine).
        for r in result["rows"]:
            if r["verdict"] in ("same", "better"):
                assert r["ci_low"] is None and r["margin"] > 0, r
            elif r["verdict"] == "not judged":
                assert r["why"], r
    assert len(result["a_runs"]) == 2 and len(result["b_runs"]) == 2


@pytest.mark.timeout(600)
def test_a_real_regression_is_found_between_runs(repeat: Repeat, tmp_path: Path) -> None:
    # The embedded target's first-token delay doubled (80 -> 160 ms median) in r1 and r2:
    # worse on TTFT, by more than the margin, wherever the phase was judged; exit 1.
    js, md = tmp_path / "reg.json", tmp_path / "reg.md"
    proc = run_cli("compare", *map(str, (repeat["a1"], repeat["a2"], repeat["a3"], repeat["a4"],
                                         "--", repeat["r1"], repeat["r2"])),
                   "--different-scenarios", "--json", str(js), "--markdown", str(md))
    rows = _rows(js)
    found = []
    for phase in ("baseline", "recovery"):
        r = rows[(phase, "ttft_ms", 50)]
        if r["verdict"] == "not judged":        # a busy machine: said why
            assert r["why"], r
            continue
        if r["verdict"] == "no data":           # a load that started late: no request there
            continue
        assert r["verdict"] == "worse" and r["diff"] > r["margin"] > 0, r
        assert 50 < r["diff"] < 110, r          # 160 - 80 ms medians
        found.append(phase)
    result = json.loads(js.read_text())
    assert proc.returncode == (1 if result["regression"] else 0), proc.stdout + proc.stderr
    if not found:                               # nothing could be judged: said, no gate
        assert "not judged" in proc.stdout, proc.stdout
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # ITL was not touched.
    assert all(r["verdict"] != "worse" for k, r in rows.items() if k[1] == "itl_ms")
    text = md.read_text()
    assert text.startswith("## streamquake compare: worse") and "| spread |" in text
    assert "(4 run(s))" in text and "(2 run(s))" in text


@pytest.mark.timeout(600)
def test_a_saturated_phase_is_not_judged(repeat: Repeat, tmp_path: Path) -> None:
    # f: the slow target with the load generator frozen 150 ms a second: its guard marks
    # its phases saturated. Its TTFT reads twice A's, beyond any margin, yet is not judged:
    # the harness's own trouble is never the service's. Its error rate still is.
    frozen = sorted(_saturated(repeat["f"]) & {"baseline", "recovery"})
    assert frozen, repeat.stdout["f"][-2000:]
    js = tmp_path / "sat.json"
    proc = run_cli("compare", *map(str, (repeat["a1"], repeat["a2"], repeat["a3"], "--",
                                         repeat["f"])),
                   "--different-scenarios", "--json", str(js))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(js.read_text())
    rows = _rows(js)
    out = " ".join(proc.stdout.split())
    for phase in frozen:
        r = rows[(phase, "ttft_ms", 50)]
        assert r["verdict"] == "not judged", r
        if r["a"] is not None:
            assert r["b"] - r["a"] > r["margin"], r      # it would have been "worse"
        why = f"the load generator was saturated in {phase} of run {repeat['f']}"
        assert r["why"].startswith(why), r
        assert f"{phase} timings not judged: {why}" in out, out
        assert any(n.startswith(f"{phase} timings not judged: {why}")
                   for n in result["notes"]), result["notes"]
        errors = rows[(phase, "error_rate", None)]      # rates are no timings: judged
        assert errors["verdict"] != "worse" and "saturated" not in (errors["why"] or ""), errors
    assert "no regression" in out and result["regression"] is False


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
            expected = summary[f"p{r['percentile']:g}"]
            assert r["a"] == (None if expected is None else pytest.approx(expected, rel=1e-3)), r
    # The scenario's recovery.slack (20 ms) is the floor for latencies, as in `history`.
    assert result["slack_ms"] == 20
    assert all(r["margin"] >= 20 for r in result["rows"] if r["metric"].endswith("_ms"))


@pytest.mark.timeout(120)
def test_runs_of_different_scenarios_are_refused(runs: Runs) -> None:
    proc = run_cli("compare", str(runs["a"].out), str(runs["b"].out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different definitions of scenario 'quick'" in lines[0], lines
    assert "--different-scenarios" in lines[0] and proc.stdout == ""


@pytest.mark.timeout(120)
def test_a_report_without_samples_is_compared_by_point_estimates(runs: Runs,
                                                                 tmp_path: Path) -> None:
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(runs["b"].out / "report.json", lone / "report.json")
    proc = run_cli("compare", str(runs["a"].out), str(lone), "--json", str(tmp_path / "c.json"),
                   "--different-scenarios", "--min-runs", "1")
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
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
    # One run, or sides split twice: which runs are A and which B is not known.
    for args in ([str(tmp_path)], [str(tmp_path), "--", str(tmp_path), "--", str(tmp_path)],
                 [str(tmp_path), "--"], [str(tmp_path)] * 3):
        proc = run_cli("compare", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert "compare A1 A2 A3 -- B1 B2" in lines[0], lines
