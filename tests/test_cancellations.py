"""Client cancellations (a request class's ``cancel``): a share of the class's streams, drawn from
the scenario's seed, is closed by the client at its Nth token or after a time. A real
``streamquake run`` against the embedded target (its send log the server's side of it) counts
them apart, per phase and class, and keeps them out of the completed streams' figures."""

from __future__ import annotations

import csv
import json
import math
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake.errors import ScenarioError
from streamquake.scenario import load_scenario
from tests.conftest import run_cli
from tests.engines.llama_server import EXACT_LENGTH, LlamaServer, serve
from tests.helpers import assert_run_ended, assert_run_ok

TOKENS = 30
AFTER = 4
SHARE = 0.4
AFTER_MS = 100.0      # the clock's class: a stream takes 20 ms + 29 x 8 ms, so none ends first

SCENARIO = f"""\
name: cancellations-test
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: 20ms
    itl: 8ms
    output_tokens: {{min: {TOKENS}, max: {TOKENS}}}
    send_log: SEND_LOG
    seed: 3
  timeout: 10s
  probe: false
load:
  users: 8
  think_time: {{min: 5ms, max: 15ms}}
  classes:
    - {{name: patient, prompt: "Say something.", max_tokens: {TOKENS}}}
    - name: impatient
      prompt: "Say something else."
      max_tokens: {TOKENS}
      cancel: {{share: {SHARE:.0%}, after_tokens: {AFTER}}}
    - name: stopper
      prompt: "Say something new."
      max_tokens: {TOKENS}
      cancel: {{share: {SHARE:.0%}, after: {AFTER_MS:g}ms}}
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
def test_a_share_of_a_class_is_cancelled_after_n_tokens_or_ms_and_counted_apart(
        tmp_path: Path) -> None:
    report, rows, sends = _run(tmp_path)
    measured = [p for p in report["phases"] if p["name"] in ("baseline", "fault", "recovery")]
    assert len(measured) == 3
    # A stream the clock closed before its first token came (a busy machine's: its 100 ms
    # passed first) has no TTFT to count; only the clock's class may have one.
    tokenless = [r for r in rows if r["cancelled"] == "yes" and not r["ttft_ms"]]
    assert all(r["class"] == "stopper" and int(r["content_events"]) == 0 for r in tokenless), \
        tokenless
    for phase in measured:
        assert phase["classes"]["patient"]["cancelled"] == 0
        for name in ("impatient", "stopper"):
            cls = phase["classes"][name]
            ended = cls["requests"] + cls["cancelled"]
            assert ended >= 8, (phase["name"], name, cls)
            # Binomial: the count within 4 standard deviations of share * n.
            sd = math.sqrt(ended * SHARE * (1 - SHARE))
            assert abs(cls["cancelled"] - SHARE * ended) <= 4 * sd, (phase["name"], name, cls)
            # Neither a success nor an error: the completed streams are what is left.
            assert cls["successes"] == cls["requests"] == ended - cls["cancelled"]
            # Their first tokens count (those that came before the close); their E2E does not.
            no_first = sum(1 for r in tokenless
                           if r["phase"] == phase["name"] and r["class"] == name)
            assert cls["ttft_ms"]["count"] == ended - no_first, (phase["name"], name, cls)
            assert cls["e2e_ms"]["count"] == cls["successes"]
            assert cls["usage_tokens"] == TOKENS * cls["successes"]
        stats = phase["stats"]
        assert stats["cancelled"] == sum(c["cancelled"] for c in phase["classes"].values())
        assert stats["cancelled_share"] == pytest.approx(
            stats["cancelled"] / (stats["requests"] + stats["cancelled"]))
        assert stats["error_rate"] == 0.0
    scored = [r for r in rows if r["phase"] in ("baseline", "fault", "recovery")]
    cancelled = [r for r in scored if r["cancelled"] == "yes"]
    completed = [r for r in scored if r["cancelled"] != "yes"]
    assert {r["class"] for r in cancelled} == {"impatient", "stopper"}
    assert all(r["error"] == "" for r in cancelled)
    assert all(int(r["content_events"]) == AFTER for r in cancelled if r["class"] == "impatient")
    # The clock's: closed no sooner than AFTER_MS from the attempt's start (the send, then the
    # E2E from the write), with the answer unfinished.
    for r in (r for r in cancelled if r["class"] == "stopper"):
        assert float(r["send_ms"]) + float(r["e2e_ms"]) >= AFTER_MS - 1.0, r
        assert int(r["content_events"]) < TOKENS, r
    assert all(int(r["output_tokens"]) == TOKENS and r["error"] == "" for r in completed)
    # The server's side: it stopped sending the cancelled streams early (the connection went),
    # and finished the rest. A client late to read its 4th token (a busy machine) may find
    # the server already done with a stream: most, not all, must show it.
    by_trace = {s["trace_id"]: s for s in sends}
    cut = [by_trace[r["trace_id"]] for r in cancelled
           if not by_trace[r["trace_id"]]["complete"]]
    assert len(cut) >= 0.8 * len(cancelled), (len(cut), len(cancelled))
    assert all(AFTER <= sum(sent["content"]) < TOKENS for sent in cut), cut
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


# -- against llama-server ------------------------------------------------------------------------

LLAMA_TOKENS = 64     # each answer exactly so long (EXACT_LENGTH): 0.5-1 s on the suite's model
STALE = "the server closed the connection before answering"   # its keep-alive race, counted


@pytest.fixture(scope="module")
def counting_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama-server as the suite starts it, with its Prometheus counters (--metrics): its own
    count of the tokens it generated, cancelled requests' included (a request cancelled after 6
    events counted 5 here), is the server's side of a cancellation."""
    yield from serve(tmp_path_factory.mktemp("llama-metrics"), extra=("--metrics",))


def _tokens_generated(server: LlamaServer) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    (value,) = [float(line.split()[1]) for line in text.splitlines()
                if line.startswith("llamacpp:tokens_predicted_total ")]
    return value


def _llama_run(path: Path, server: LlamaServer) -> tuple[float, list[dict[str, str]]]:
    """One run of the scenario at ``path``: llama-server's count of the tokens it generated in
    it, and the run's samples."""
    before = _tokens_generated(server)
    out = path.parent / f"out-{path.stem}"
    proc = run_cli("run", str(path), "--out", str(out), timeout=150)
    assert_run_ended(proc)
    # A cancelled request's slot is released when the engine sees the close: give it a moment.
    time.sleep(1.0)
    generated = _tokens_generated(server) - before
    with open(out / "samples.csv", encoding="utf-8") as f:
        return generated, list(csv.DictReader(f))


# Enough of each kind to average over; a busy machine (llama-server slower) gets more runs.
ENOUGH, RUNS = 8, 3


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_on_llama_server_a_cancelled_stream_gives_its_capacity_back(
        tmp_path: Path, counting_llama: LlamaServer) -> None:
    """A cancelled stream stops the engine's work on it: llama-server's own count of the tokens
    it generated in the run is the completed streams' tokens plus a few per cancelled one (the
    AFTER the client read, and what was under way when the close reached it), not the whole
    answer each cancelled stream asked for. One run gives enough streams on a quiet machine; on
    a busy one the same run is made again (at most RUNS in all) and the counts added up."""
    body = {"messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": LLAMA_TOKENS, **EXACT_LENGTH}
    scenario = f"""\
name: cancellations-llama-server
target: {{protocol: openai, model: tiny, url: "{counting_llama.url}", timeout: 30s,
          probe: false}}
load:
  users: 4
  think_time: {{min: 0ms, max: 20ms}}
  classes:
    - {{name: patient, body: {json.dumps(body)}}}
    - name: impatient
      body: {json.dumps(body)}
      cancel: {{share: 100%, after_tokens: {AFTER}}}
  seed: 11
phases: {{warmup: 1s, baseline: 3s, fault: 3s, recovery: 3s}}
slos:
  - {{metric: error_rate, max: 10%}}
"""
    generated, rows, runs = 0.0, [], 0
    while runs < RUNS:
        runs += 1
        path = tmp_path / f"cancel-llama-{runs}.yaml"
        path.write_text(scenario)
        tokens, more = _llama_run(path, counting_llama)
        generated += tokens
        rows += more
        if min(sum(r["cancelled"] == "yes" for r in rows),
               sum(r["cancelled"] != "yes" and not r["error"] for r in rows)) >= ENOUGH:
            break
    failed = [r for r in rows if r["error"]]
    # The only error allowed: a request llama-server's closing keep-alive connection lost
    # before any byte of it reached the engine (no token generated for it).
    assert all(r["error"] == "connect" and r["error_detail"] == STALE for r in failed), failed
    assert len(failed) <= 2 * runs, failed
    cancelled = [r for r in rows if r["cancelled"] == "yes"]
    completed = [r for r in rows if r["cancelled"] != "yes" and not r["error"]]
    assert {r["class"] for r in cancelled} == {"impatient"}
    assert len(cancelled) >= ENOUGH and len(completed) >= ENOUGH, \
        (len(cancelled), len(completed), runs)
    assert all(int(r["content_events"]) == AFTER for r in cancelled), cancelled
    assert all(int(r["output_tokens"]) == LLAMA_TOKENS for r in completed), completed
    # The engine's tokens beyond the completed answers' are the cancelled streams': at least
    # the AFTER each was read, and far fewer than their whole answers (LLAMA_TOKENS each).
    beyond = generated - LLAMA_TOKENS * len(completed)
    per_cancelled = beyond / len(cancelled)
    print(f"\nllama-server generated {generated:.0f} tokens in {runs} run(s): {len(completed)} "
          f"completed answers of {LLAMA_TOKENS}, {len(cancelled)} cancelled after {AFTER} "
          f"({per_cancelled:.1f} generated per cancelled stream)")
    assert AFTER <= per_cancelled <= LLAMA_TOKENS / 4, (generated, len(completed), len(cancelled))
