"""Client cancellations (a request class's ``cancel``): a share of the class's streams, drawn from
the scenario's seed, is closed by the client at its Nth token or after a time. A real
``streamquake run`` against the embedded target (its send log the server's side of it) counts
them apart, per phase and class, and keeps them out of the completed streams' figures."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from streamquake.errors import ScenarioError
from streamquake.scenario import load_scenario
from tests.conftest import run_cli
from tests.helpers import assert_run_ok

TOKENS = 30
AFTER = 4
SHARE = 0.4

SCENARIO = f"""\
name: cancellations-test
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: 20ms
    itl: 4ms
    output_tokens: {{min: {TOKENS}, max: {TOKENS}}}
    send_log: SEND_LOG
    seed: 3
  timeout: 10s
  probe: false
load:
  users: 6
  think_time: {{min: 5ms, max: 15ms}}
  classes:
    - {{name: patient, prompt: "Say something.", max_tokens: {TOKENS}}}
    - name: impatient
      prompt: "Say something else."
      max_tokens: {TOKENS}
      cancel: {{share: {SHARE:.0%}, after_tokens: {AFTER}}}
  seed: 11
phases: {{baseline: 2s, fault: 2s, recovery: 2s}}
slos:
  - {{metric: error_rate, max: 0%}}
"""


def _run(tmp_path: Path) -> tuple[dict[str, Any], list[dict[str, str]], list[dict[str, Any]]]:
    log = tmp_path / "sends.jsonl"
    scenario = tmp_path / "cancel.yaml"
    scenario.write_text(SCENARIO.replace("SEND_LOG", json.dumps(str(log))))
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=120)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    with open(out / "samples.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    sends = [json.loads(line) for line in log.read_text().splitlines()]
    return report, rows, sends


@pytest.mark.timeout(150)
def test_a_share_of_a_class_is_cancelled_after_n_tokens_and_counted_apart(
        tmp_path: Path) -> None:
    report, rows, sends = _run(tmp_path)
    measured = [p for p in report["phases"] if p["name"] in ("baseline", "fault", "recovery")]
    assert len(measured) == 3
    for phase in measured:
        impatient = phase["classes"]["impatient"]
        patient = phase["classes"]["patient"]
        ended = impatient["requests"] + impatient["cancelled"]
        assert ended >= 20, (phase["name"], impatient)
        # Binomial: the count within 4 standard deviations of share * n (and never 0 or all).
        sd = math.sqrt(ended * SHARE * (1 - SHARE))
        assert abs(impatient["cancelled"] - SHARE * ended) <= 4 * sd, (phase["name"], impatient)
        assert 0 < impatient["cancelled"] < ended
        assert patient["cancelled"] == 0
        assert phase["stats"]["cancelled"] == impatient["cancelled"]
        assert phase["stats"]["cancelled_share"] == pytest.approx(
            impatient["cancelled"] / (phase["stats"]["requests"] + impatient["cancelled"]))
        # Neither a success nor an error: the completed streams are what is left.
        assert phase["stats"]["error_rate"] == 0.0
        assert impatient["successes"] == impatient["requests"] == ended - impatient["cancelled"]
        # Their first tokens count; their E2E does not (every E2E is a whole answer's).
        assert impatient["ttft_ms"]["count"] == ended
        assert impatient["e2e_ms"]["count"] == impatient["successes"]
        assert impatient["usage_tokens"] == TOKENS * impatient["successes"]
    scored = [r for r in rows if r["phase"] in ("baseline", "fault", "recovery")]
    cancelled = [r for r in scored if r["cancelled"] == "yes"]
    completed = [r for r in scored if r["cancelled"] != "yes"]
    assert cancelled and all(r["class"] == "impatient" for r in cancelled)
    assert all(int(r["content_events"]) == AFTER and r["error"] == "" for r in cancelled)
    assert all(int(r["output_tokens"]) == TOKENS and r["error"] == "" for r in completed)
    # The E2E of every completed stream is longer than the longest cancelled one's close: no
    # cut-short stream hides among them (30 tokens at 4 ms against 4).
    assert min(float(r["e2e_ms"]) for r in completed) > max(float(r["e2e_ms"])
                                                            for r in cancelled)
    # The server's side: it stopped sending each cancelled stream early, and finished the rest.
    by_trace = {s["trace_id"]: s for s in sends}
    for r in cancelled:
        sent = by_trace[r["trace_id"]]
        assert not sent["complete"], sent
        assert AFTER <= sum(sent["content"]) < TOKENS, sent
    for r in completed:
        sent = by_trace[r["trace_id"]]
        assert sent["complete"] and sum(sent["content"]) == TOKENS, sent
    assert "| cancelled by the client (share) |" in (tmp_path / "out" / "summary.md"
                                                     ).read_text()


def _bad(tmp_path: Path, cancel: str) -> list[str]:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\n"
        "target: {protocol: openai, embedded: {}}\n"
        "load:\n"
        "  classes:\n"
        "    - name: quitter\n"
        f"      cancel: {cancel}\n"
        "phases: {baseline: 2s, fault: 2s, recovery: 2s}\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return [p.removeprefix(f"{path}:") for p in info.value.problems]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("cancel", "where", "says"), [
    ("{share: 30%}", "6:7: load.classes.0.cancel:", "give exactly one of 'after'"),
    ("{share: 30%, after: 500ms, after_tokens: 5}", "6:7: load.classes.0.cancel:",
     "give exactly one of 'after'"),
    ("{share: 130%, after_tokens: 5}", "6:16: load.classes.0.cancel.share:", "100%"),
    ("{share: 30%, after_tokens: 0}", "6:28: load.classes.0.cancel.after_tokens:", "1"),
    ("{share: 30%, after: soon}", "6:28: load.classes.0.cancel.after:", "duration"),
    ("{share: 30%, after_token: 5}", "6:28: load.classes.0.cancel.after_token:", "after_tokens"),
])
def test_bad_cancel_settings_are_located(tmp_path: Path, cancel: str, where: str,
                                         says: str) -> None:
    problems = _bad(tmp_path, cancel)
    assert len(problems) == 1, problems
    assert problems[0].startswith(where), problems
    assert says in problems[0], problems
