"""report.html, ``compare``, ``history``, the Prometheus figures and the saturation guard over N
steps (``steps:``): two real steps runs against the embedded target through the real CLI, one
with an extra step. report.html parses and shows every step (the timeline strip, the step
table, the per-second charts' step windows), every fault window (a flapping one: its
on-states) and one before / during / after panel per fault step; compare matches steps by
name and says which step one side lacks; the exposition labels its figures with the steps;
the history store keeps the steps and reads them back."""

from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.chromium import Chromium
from tests.conftest import REPO, run_cli
from tests.helpers import assert_run_ended

SCENARIO = """
name: steps-outputs
target:
  protocol: openai
  embedded: {{ttft: 30ms, itl: 10ms, output_tokens: {{min: 20, max: 20}}, seed: 7,
              sse_event_ids: true}}
  timeout: 10s
load: {{users: 4, think_time: {{min: 30ms, max: 60ms}}, seed: 7{saturation}}}
faults:
  - {{type: sse_proxy, name: slow-tokens, delay: 30ms}}
  - {{type: sse_proxy, name: lossy, drop: 20%, seed: 7, flap: {{on: 1s, off: 1s}}}}
steps:
  - {{name: warm, kind: warmup, duration: 1s}}
  - {{name: before, kind: baseline, duration: 3s}}
  - {{name: f-slow, kind: fault, duration: 3s, faults: [slow-tokens]}}
  - {{name: r-slow, kind: recovery, duration: 3s}}
  - {{name: f-lossy, kind: fault, duration: 4s, faults: [lossy], load: {{users: 6}}}}
  - {{name: r-lossy, kind: recovery, duration: 3s}}
{extra}slos:
  - {{metric: ttft_ms, percentile: 95, max: 2s, phases: [baseline, recovery]}}
recovery: {{tolerance: 100%, metrics: [ttft_ms]}}
verdicts: {{inconclusive: pass}}
"""
STEPS = ["warm", "before", "f-slow", "r-slow", "f-lossy", "r-lossy"]
PANELS = {"f-slow": ("before", "r-slow"), "f-lossy": ("before", "r-lossy")}


@dataclass
class Run:
    out: Path
    proc: subprocess.CompletedProcess[str]
    prom: Path
    report: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """``a``: the timeline; ``b``: the same with a baseline step more at the end and the
    saturation guard set to fail (a check per measured step). Both append to one store."""
    root = tmp_path_factory.mktemp("steps-outputs")
    texts = {"a": SCENARIO.format(extra="", saturation=""),
             "b": SCENARIO.format(extra="  - {name: tail, kind: baseline, duration: 2s}\n",
                                  saturation=", saturation: fail")}
    got: dict[str, Run] = {}

    def one(name: str) -> None:
        (root / f"{name}.yaml").write_text(texts[name])
        out, prom = root / name, root / f"{name}.prom"
        proc = run_cli("run", str(root / f"{name}.yaml"), "--out", str(out), "--history",
                       str(root / "history.sqlite"), "--metrics-file", str(prom), timeout=240)
        got[name] = Run(out, proc, prom)

    threads = [threading.Thread(target=one, args=(n,)) for n in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, run in got.items():
        assert_run_ended(run.proc, said=f"run {name}: {run.proc.stdout}{run.proc.stderr}")
        run.report = json.loads((run.out / "report.json").read_text())
    return got


class _Page(HTMLParser):
    """The parts of report.html the tests ask about: text, step rows, fault panels, SVG
    shapes' hover titles by class, and each chart's key."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.step_rows: list[str] = []
        self.panels: dict[str, list[str]] = {}
        self.titles: list[tuple[str, str]] = []     # (class of the shape, its <title>)
        self.charts: list[str] = []
        self._panel: str | None = None
        self._depth = 0
        self._shape: str | None = None
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section" and "data-fault-step" in a:
            self._panel, self._depth = a["data-fault-step"], 0
            self.panels[self._panel] = []
        if tag == "section" and self._panel is not None:
            self._depth += 1
        if tag == "tr" and "data-step" in a:
            self.step_rows.append(a["data-step"])
        if tag == "svg" and "data-chart" in a:
            self.charts.append(a["data-chart"])
        if tag == "rect":
            self._shape = a.get("class", "")
        self._in_title = tag == "title" and self._shape is not None

    def handle_endtag(self, tag: str) -> None:
        if tag == "section" and self._panel is not None:
            self._depth -= 1
            if self._depth == 0:
                self._panel = None
        if tag == "title":
            self._in_title = False
        if tag == "rect":
            self._shape = None

    def handle_data(self, data: str) -> None:
        if self._in_title and self._shape is not None:
            self.titles.append((self._shape, data))
        self.text.append(data)
        if self._panel is not None:
            self.panels[self._panel].append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


@pytest.mark.timeout(300)
def test_report_html_shows_every_step_every_fault_window_and_a_panel_per_fault(
        runs: dict[str, Run]) -> None:
    run = runs["a"]
    page = _parse(run.out / "report.html")
    assert page.step_rows == STEPS
    strip = [t for cls, t in page.titles if cls.startswith("st ")]
    assert [t.split(":")[0] for t in strip] == STEPS
    assert any("f-lossy: fault" in t and "faults lossy" in t for t in strip), strip
    loads = [t for cls, t in page.titles if cls == "ld"]
    assert "f-lossy: 6 users" in loads and "before: 4 users (the scenario's)" in loads, loads
    # Every fault window: the slow one once, the flapping one each on-state, as recorded.
    windows = [t for cls, t in page.titles if cls == "fw"]
    records = {f["name"]: f for f in run.report["faults"]}
    ons = [e for e in records["lossy"]["edges"] if e["state"] == "on"]
    assert ons and len([w for w in windows if w.startswith("lossy on")]) == len(ons), windows
    assert len([w for w in windows if w.startswith("slow-tokens (sse_proxy)")]) == 1, windows
    # The per-second charts shade every step's window, by kind.
    step_windows = [t for cls, t in page.titles if cls.startswith("sw ")]
    timeline_charts = [c for c in page.charts if c.startswith("timeline-")]
    assert len(timeline_charts) == 6
    for step in STEPS:
        assert sum(t.startswith(f"step {step} (") for t in step_windows) == 6, step
    # One panel per fault step: its before / during / after, values with counts and intervals,
    # its verdicts and its faults.
    assert set(page.panels) == set(PANELS)
    for step, (before, after) in PANELS.items():
        text = " ".join(" ".join(page.panels[step]).split())
        assert f"fault step {step}" in text and f"before {before} / during {step} / after " \
            f"{after}" in text, text[:300]
        for row in ("TTFT p95 ms", "TTFT values (n)", "ITL gaps (n)", "requests sent"):
            assert row in text, (step, row)
        assert "ttft_ms p95 recovers to baseline" in text and f"after {step}:" in text
        assert "95% CI" in text and "n=" in text
    assert "fault lossy" in " ".join(page.panels["f-lossy"])
    assert "slow-tokens" in " ".join(page.panels["f-slow"])
    text = " ".join(page.text)
    assert "Latency distribution per step" in text


@pytest.mark.timeout(300)
def test_report_html_renders_offline_in_chromium(runs: dict[str, Run]) -> None:
    html = runs["a"].out / "report.html"
    assert "<script" not in html.read_text()
    browser = Chromium()
    try:
        loaded = browser.load(html, {"strip": "document.querySelectorAll("
                                              "'svg.strip rect').length"},
                              screenshot=REPO / "out" / "test-artifacts" / "report-steps.png")
    finally:
        browser.close()
    assert loaded.console_errors == [], loaded.console_errors
    assert [u for u in loaded.requests if not u.startswith(("file:", "data:"))] == []
    assert loaded.values["strip"] >= 2 * len(STEPS) + 2     # steps, loads, fault windows


@pytest.mark.timeout(300)
def test_compare_matches_steps_by_name_and_says_which_one_side_lacks(
        runs: dict[str, Run], tmp_path: Path) -> None:
    a, b = runs["a"], runs["b"]
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    proc = run_cli("compare", str(a.out), str(b.out), "--different-scenarios", "--resamples",
                   "200", "--markdown", str(md), "--json", str(js), timeout=240)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "step tail is in B only (A has no step of that name): not compared" in out, out
    data = json.loads(js.read_text())
    assert data["steps"] == STEPS[1:]
    assert data["one_side"] == [{"run": "B", "step": "tail"}]
    assert {r["phase"] for r in data["rows"]} == set(STEPS[1:])
    text = md.read_text()
    for step in STEPS[1:]:
        assert f"### {step}\n" in text
    assert "### tail" not in text and "step tail is in B only" in text
    # The other way round, the step is A's own.
    back = run_cli("compare", str(b.out), str(a.out), "--different-scenarios", "--resamples",
                   "0", timeout=240)
    assert "step tail is in A only" in " ".join(back.stdout.split()), back.stdout


def _prom(path: Path) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value)
            for fam in text_string_to_metric_families(path.read_text()) for s in fam.samples]


@pytest.mark.timeout(300)
def test_prometheus_figures_carry_the_steps(runs: dict[str, Run]) -> None:
    samples = _prom(runs["a"].prom)
    info = {lab["phase"]: (lab["kind"], lab["index"]) for n, lab, v in samples
            if n == "streamquake_step_info" and v == 1}
    kinds = {p["name"]: p["kind"] for p in runs["a"].report["phases"]}
    assert info == {s: (kinds[s], str(i)) for i, s in enumerate(STEPS)}
    current = {lab["phase"] for n, lab, _ in samples if n == "streamquake_phase"}
    assert current == set(STEPS)
    # Each measured step's figures under its name, as many requests as the report counts.
    for p in runs["a"].report["phases"]:
        sent = sum(v for n, lab, v in samples
                   if n == "streamquake_requests_sent_total" and lab["phase"] == p["name"])
        assert sent == p["stats"]["sent"], (p["name"], sent, p["stats"]["sent"])
    assert any(n == "streamquake_ttft_seconds_count" and lab["phase"] == "f-lossy" and v > 0
               for n, lab, v in samples)


@pytest.mark.timeout(300)
def test_history_stores_the_steps_and_reads_them_back(runs: dict[str, Run],
                                                      tmp_path: Path) -> None:
    from streamquake.reports.history import read_runs, stored_phases

    store = runs["a"].out.parent / "history.sqlite"
    stored = {r.report: r for r in read_runs(store, "steps-outputs")}
    a = stored[str(runs["a"].out / "report.json")]
    b = stored[str(runs["b"].out / "report.json")]
    assert stored_phases(a) == STEPS[1:] and stored_phases(b) == [*STEPS[1:], "tail"]
    for step in STEPS[1:]:
        p = next(p for p in runs["a"].report["phases"] if p["name"] == step)
        assert a.values[f"{step}.ttft_ms.p95"] == p["stats"]["ttft_ms"]["p95"]
        assert a.values[f"{step}.requests.value"] == p["stats"]["requests"]
    proc = run_cli("history", str(store), "--min-runs", "1", timeout=240)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "steps-outputs" in out and "f-lossy" in out and "r-lossy" in out, proc.stdout


@pytest.mark.timeout(300)
def test_saturation_guard_checks_every_measured_step_by_kind(runs: dict[str, Run]) -> None:
    checks = [c for c in runs["b"].report["checks"] if c["name"] == "load generator not saturated"]
    assert [c["phase"] for c in checks] == [*STEPS[1:], "tail"]
