"""report.html in a real headless Chromium, offline: it loads with no console error and fetches
nothing, every chart is there with lines drawn, fault windows are shaded and labelled, GPU
telemetry and the history trend appear when the run has them. A screenshot of each page is
kept under out/test-artifacts/ (the README's picture is made the same way)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chromium import Chromium
from tests.conftest import REPO
from tests.report_runs import Runs, report_runs

ARTIFACTS = REPO / "out" / "test-artifacts"
MAX_HTML_BYTES = 150_000

CHARTS_JS = """JSON.stringify([...document.querySelectorAll('svg.chart')].map(s => {
  const box = s.getBoundingClientRect();
  return {key: s.dataset.chart, w: box.width, h: box.height,
          lines: s.querySelectorAll('polyline').length,
          points: [...s.querySelectorAll('polyline')].reduce(
              (n, p) => n + p.getAttribute('points').split(' ').length, 0),
          bands: [...s.querySelectorAll('rect.band')].map(r => r.getBoundingClientRect().width),
          labels: [...s.querySelectorAll('text.bl')].map(t => t.textContent)};
}))"""
TEXT_JS = "document.body.innerText"


@pytest.fixture(scope="module")
def runs() -> Runs:
    return report_runs()


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    chromium = Chromium()
    try:
        yield chromium
    finally:
        chromium.close()


def _load(browser: Chromium, runs: Runs, name: str) -> tuple[list[dict], str]:
    page = runs[name].out / "report.html"
    loaded = browser.load(page, {"charts": CHARTS_JS, "text": TEXT_JS},
                          screenshot=ARTIFACTS / f"report-{name}.png")
    assert loaded.console_errors == [], loaded.console_errors
    assert [u for u in loaded.requests if not u.startswith(("file:", "data:"))] == []
    return json.loads(loaded.values["charts"]), str(loaded.values["text"])


@pytest.mark.timeout(240)
def test_static_file_is_self_contained_and_small(runs: Runs) -> None:
    for name in ("a", "a2", "b", "c", "d", "e"):
        html = (runs[name].out / "report.html").read_text()
        assert "<script" not in html and "http://" not in html.replace(
            "http://127.0.0.1", "").replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert "https://" not in html and "<link" not in html and "@import" not in html
        assert len(html.encode()) < MAX_HTML_BYTES, (name, len(html.encode()))


@pytest.mark.timeout(120)
def test_full_report_renders_every_chart_with_fault_windows(browser: Chromium,
                                                            runs: Runs) -> None:
    charts, text = _load(browser, runs, "a")
    by_key = {c["key"]: c for c in charts}
    timeline = [k for k in by_key if k.startswith("timeline-")]
    assert sorted(timeline) == sorted(["timeline-ttfb_ms", "timeline-ttft_ms", "timeline-itl_ms",
                                       "timeline-e2e_ms", "timeline-output_tokens_per_s",
                                       "timeline-load"])
    assert sorted(k for k in by_key if k.startswith("cdf-")) == [
        "cdf-e2e_ms", "cdf-itl_ms", "cdf-ttfb_ms", "cdf-ttft_ms"]
    report = json.loads((runs["a"].out / "report.json").read_text())
    for key in timeline:
        chart = by_key[key]
        assert chart["w"] > 800 and chart["h"] > 150
        assert chart["lines"] >= 1 and chart["points"] >= len(report["timeline"]) - 2, chart
        assert len(chart["bands"]) == 1 and chart["bands"][0] > 100, chart   # ~5 s of ~16
        assert chart["labels"] == ["chunk-drop (sse_proxy)"]
    for key in ("cdf-ttft_ms", "cdf-itl_ms"):
        assert by_key[key]["lines"] == 3                     # baseline, fault, recovery
    for heading in ("SLO verdicts", "Measured per phase", "Timeline, per second",
                    "Latency distribution per phase", "Per request class", "Fault ledger",
                    "Environment"):
        assert heading in text, heading
    assert "stats.events_dropped=" in text and "scenario_sha256" in text
    assert not any(k.startswith("gpu-") for k in by_key)   # no NVML in this run


@pytest.mark.timeout(120)
def test_gpu_telemetry_is_drawn_when_the_run_recorded_it(browser: Chromium, runs: Runs) -> None:
    charts, text = _load(browser, runs, "a2")
    gpu = {c["key"]: c for c in charts if c["key"].startswith("gpu-")}
    assert set(gpu) == {"gpu-sm_clock_mhz", "gpu-util_gpu_pct", "gpu-power_w"}
    assert gpu["gpu-sm_clock_mhz"]["points"] >= 10 and gpu["gpu-sm_clock_mhz"]["bands"]
    assert "GPU telemetry" in text


@pytest.mark.timeout(120)
def test_history_trend_shows_in_the_last_appended_run(browser: Chromium, runs: Runs) -> None:
    import sqlite3

    with sqlite3.connect(runs.history) as db:
        (report,) = db.execute("SELECT report FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    html = Path(report).with_name("report.html")
    name = html.parent.name
    charts, text = _load(browser, runs, name)
    trend = {c["key"]: c for c in charts if c["key"].startswith("trend-")}
    assert set(trend) == {"trend-ttft_ms", "trend-itl_ms", "trend-e2e_ms"}
    assert trend["trend-ttft_ms"]["lines"] == 3                # one per phase, 3 runs each
    assert trend["trend-ttft_ms"]["points"] == 9
    assert "Trend: this scenario in the history store" in text
    # Two runs before it: too few for the default check, and the page says so.
    assert re.search(r"not judged: not enough history \(2 of \d+ earlier runs", text), text


def test_trend_axis_names_runs_and_rings_a_regression() -> None:
    import re

    from streamquake.reports.html import render_html
    from streamquake.result import PhaseResult, RunResult, TrendPoint

    trend = [TrendPoint(run_id, 1.7e9 + run_id, 0, {f"{p}.ttft_ms.p95": 80.0 + (run_id == 9)
                                                     * 240 for p in ("baseline", "recovery")})
             for run_id in (4, 7, 9)]
    trend[-1].regressed, trend[-1].judgement = ["baseline.ttft_ms.p95"], "quick: REGRESSED"
    result = RunResult("quick", "q.yaml", {}, "1.2.3", 1.7e9, 1.7e9 + 1, None,
                       [PhaseResult("baseline", 0.0, 1.0, {})], [], [], {},
                       environment={"streamquake": "1.2.3", "host": "h"}, trend=trend)
    html = render_html(result)
    chart = re.search(r'<svg[^>]*data-chart="trend-ttft_ms".*?</svg>', html).group(0)
    # One tick per run, named by its id in the store: no fractional runs.
    assert re.findall(r'<text class="xl"[^>]*>([^<]*)</text>', chart) == ["4", "7", "9", "run"]
    assert re.findall(r'<circle class="mark".*?<title>([^<]*)</title>', chart) == [
        "REGRESSION: baseline ttft_ms p95 in run 9"]
    assert "quick: REGRESSED" in html
    other = re.search(r'<svg[^>]*data-chart="trend-itl_ms".*?</svg>', html).group(0)
    assert 'class="mark"' not in other
    # The version is one row of the environment, not two.
    assert len(re.findall(r"<tr><td>streamquake</td>", html)) == 1


@pytest.mark.timeout(120)
def test_reports_of_runs_that_stopped_early_render(browser: Chromium, runs: Runs) -> None:
    _, text = _load(browser, runs, "c")
    assert "interrupted by SIGINT during fault; not run: recovery" in text
    assert "not run" in text
    charts, text = _load(browser, runs, "d")
    assert charts == [] and "RUN FAILED (exit 3)" in text and "is unreachable" in text


# Every word (a run of non-space, non-comma characters) of the fault ledger's key=value cells
# that fits a cell: on how many lines it was drawn.
LEDGER_JS = r"""JSON.stringify((() => {
  const broken = []; let words = 0;
  for (const td of document.querySelectorAll('td.kv')) {
    const walk = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) {
      for (const m of n.data.matchAll(/[^\s,]+/g)) {
        if (m[0].length > 30) continue;
        words++;
        const r = document.createRange();
        r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        const tops = new Set([...r.getClientRects()].map(x => Math.round(x.top)));
        if (tops.size > 1) broken.push(m[0]);
      }
    }
  }
  return {words, broken};
})())"""


@pytest.mark.timeout(120)
def test_the_fault_ledger_breaks_its_cells_between_words(browser: Chromium, runs: Runs) -> None:
    loaded = browser.load(runs["a"].out / "report.html", {"ledger": LEDGER_JS})
    ledger = json.loads(loaded.values["ledger"])
    assert ledger["words"] > 20, ledger
    assert ledger["broken"] == [], ledger
