"""A real streaming request per class before the load (issue 23): a target that answers 404,
401, an HTML page, or a stream with no token stops the run with exit 3 and the reason before
any load or fault; ``streamquake probe`` makes the same check alone."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, listening, run_cli

KEY = "sk-probe-2718281828459045235360287"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from listening([sys.executable, str(REPO / "tests" / "hostile_server.py")],
                         "hostile server")


SCENARIO = """
name: probed
target:
  protocol: openai
  {target}
  headers: {{Authorization: "Bearer ${{SQ_PROBE_KEY}}"}}
load:
  users: 2
  classes: [{{name: chat, prompt: hi, max_tokens: 5}}, {{name: short, prompt: yo, max_tokens: 3}}]
phases: {{warmup: 3s, baseline: 3s, fault: 0s, recovery: 0s}}
slos: [{{metric: error_rate, max: 1%}}]
"""
# The warm-up: on a busy machine Locust took over 3 s to start, and a baseline with none before
# it measured no request at all.


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("path", "says"), [
    ("/plain-404", "HTTP 404: File Not Found"),
    ("/echo-key", "HTTP 401: Incorrect API key provided: [redacted]"),
    ("/html", "it began '<html><body>Welcome to nginx!</body></html>'"),
    ("/openai-empty", "the stream ended without one event of generated text"),
])
def test_a_target_that_cannot_stream_stops_the_run_before_any_load(
        server: str, tmp_path: Path, path: str, says: str) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.format(target=f'url: "{server}"\n  path: {path}'))
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), env={"SQ_PROBE_KEY": KEY})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text
    assert "the probe before the load: class chat" in text and says in text, text
    assert KEY not in text and KEY not in (out / "report.json").read_text()
    assert not (out / "run" / "locust.log").exists()        # no load was started
    assert json.loads((out / "report.json").read_text())["phases"] == []
    # Told to skip it (a target meant to fail), the run sends its load and reports the errors.
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "o2"),
                   "--set", "target.probe=false", env={"SQ_PROBE_KEY": KEY})
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    phases = json.loads((tmp_path / "o2" / "report.json").read_text())["phases"]
    baseline = next(p for p in phases if p["name"] == "baseline")
    assert baseline["stats"]["requests"] > 0
    if path == "/plain-404":      # why they failed, in every output, with counts
        # Counted per phase, the warm-up's too.
        per = {p["name"]: p["stats"]["errors"].get("http_status", 0) for p in phases}
        where = ", ".join(f"{name} {n}" for name, n in per.items() if n)
        said = f"HTTP 404: File Not Found x{sum(per.values())} (http_status; {where})"
        assert f"failed: {said}" in proc.stdout
        assert f"- {said}" in (tmp_path / "o2" / "summary.md").read_text()
        assert f"<li>{said}</li>" in (tmp_path / "o2" / "report.html").read_text()


@pytest.mark.timeout(180)
def test_a_run_whose_classes_can_stream_says_what_its_probe_saw_and_goes_on(
        server: str, tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.format(target=f'url: "{server}/v1"'))
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"),
                   env={"SQ_PROBE_KEY": KEY})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cls in ("chat", "short"):
        assert f"probe: class {cls}: HTTP 200; first byte" in proc.stdout
    assert "8 tokens by usage, finish length, model tiny" in proc.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert next(p for p in report["phases"] if p["name"] == "baseline")["stats"]["requests"] > 0


@pytest.mark.timeout(120)
def test_probe_alone_prints_each_class_and_exits_by_what_it_saw(server: str,
                                                                 tmp_path: Path) -> None:
    proc = run_cli("probe", "--url", server + "/v1", "--model", "gpt-4o")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   class probe: HTTP 200" in proc.stdout
    assert "8 tokens by usage, finish length, model tiny" in proc.stdout
    proc = run_cli("probe", "--url", server, "--path", "/echo-key", "--header",
                   "Authorization: Bearer ${SQ_PROBE_KEY}", env={"SQ_PROBE_KEY": KEY})
    assert proc.returncode == 3
    assert "FAIL class probe: HTTP 401" in proc.stdout and KEY not in proc.stdout
    proc = run_cli("probe", "--url", "http://127.0.0.1:9")
    assert proc.returncode == 3 and "connect" in proc.stdout
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.format(target=f'url: "{server}"\n  path: /plain-404'))
    proc = run_cli("probe", str(scenario), env={"SQ_PROBE_KEY": KEY})
    assert proc.returncode == 3
    assert proc.stdout.count("FAIL class") == 2       # every class, each on its line
    # An embedded target is started for the probe, as `run` starts it (issue 34: refused).
    proc = run_cli("probe", "scenarios/quickstart.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"probing http://127\.0\.0\.1:\d+/v1/chat/completions \(openai, "
                    r"timeout 20 s\)\n", proc.stdout), proc.stdout
    assert proc.stdout.count("ok   class ") == 2
    # --json: the URL asked and each class; --timeout over the scenario's.
    proc = run_cli("probe", str(scenario), "--json", "--timeout", "3s",
                   env={"SQ_PROBE_KEY": KEY})
    doc = json.loads(proc.stdout)
    assert proc.returncode == 3 and doc["ok"] is False
    assert doc["url"] == f"{server}/plain-404" and len(doc["classes"]) == 2
    assert all(c["status"] == 404 and c["problem"] for c in doc["classes"]), doc
    proc = run_cli("probe")
    assert proc.returncode == 2 and "give a scenario file, or --url" in proc.stderr
