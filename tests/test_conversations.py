"""Conversations (a request class's ``conversation``): sessions of turns whose history grows. A
real ``streamquake run`` (Locust, loopback) against a chat server that records every request
it gets: each turn sends the shared system prefix, the earlier turns' prompts and the answers
exactly as the server sent them, then its own prompt; a failed turn ends its session, counted
failed; the report counts each turn's TTFT and E2E and the sessions' ends per step."""

from __future__ import annotations

import csv
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake.errors import ScenarioError
from streamquake.loadgen.sse_parser import SSEEvent
from streamquake.loadgen.wire import decode
from streamquake.protocols import HISTORY_FORMATS, Protocol, get, with_history
from streamquake.scenario import load_scenario
from tests.conftest import run_cli
from tests.helpers import assert_run_ok
from tests.stream_servers import ChunkedEvents, serve_in_thread

TURNS = 3
PROMPTS = ("First question, please.", "A follow-up question.", "One more thing.")
SYSTEM = "You are a careful assistant for the conversation test."
FAIL_EVERY = 3          # of the turn-2 requests, every third is answered 500
WORDS = 6


class Recorder(ChunkedEvents):
    """OpenAI chat streams whose answer names the request (`` r7w0 r7w1 ...``), every request
    recorded with its answer; every FAIL_EVERY-th second turn answered 500."""

    gap_s = 0.001
    lock = threading.Lock()
    seen: list[dict[str, Any]] = []
    second_turns = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        users = sum(m["role"] == "user" for m in body["messages"])
        with self.lock:
            index = len(self.seen)
            fail = False
            if users == 2:
                Recorder.second_turns += 1
                fail = Recorder.second_turns % FAIL_EVERY == 0
            answer = "".join(f" r{index}w{i}" for i in range(WORDS))
            trace = (self.headers.get("traceparent") or "").split("-")
            self.seen.append({"messages": body["messages"], "answer": answer, "failed": fail,
                              "trace_id": trace[1] if len(trace) > 1 else ""})
        if fail:
            data = b'{"error": {"message": "simulated failure", "type": "server_error"}}'
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": f"chatcmpl-{index}", "object": "chat.completion.chunk", "model": "sim-1"}
        for i in range(WORDS):
            self._event({**base, "choices": [{"index": 0, "delta": {"content": f" r{index}w{i}"},
                                              "finish_reason": None}]})
        self._event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 10, "completion_tokens": WORDS,
                               "total_tokens": 10 + WORDS}})
        self._event(b"[DONE]")
        self._end()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("conversations")
    prompts = "".join(f"        - {json.dumps(p)}\n" for p in PROMPTS)
    with serve_in_thread(Recorder) as url:
        scenario = tmp / "conv.yaml"
        scenario.write_text(
            "name: conversations-test\n"
            f"target: {{protocol: openai, model: sim-1, url: {json.dumps(url)}, timeout: 5s,"
            " probe: false}\n"
            "load:\n"
            "  users: 4\n"
            "  think_time: {min: 10ms, max: 20ms}\n"
            "  classes:\n"
            "    - name: chat\n"
            "      max_tokens: 6\n"
            "      prompts:\n" + prompts +
            f"      conversation: {{turns: {TURNS}, think_time: {{min: 20ms, max: 40ms}},"
            f" system_prefix: {json.dumps(SYSTEM)}}}\n"
            "  seed: 5\n"
            "phases: {baseline: 2s, fault: 2s, recovery: 2s}\n")
        out = tmp / "out"
        proc = run_cli("run", str(scenario), "--out", str(out), timeout=120)
        with Recorder.lock:
            seen = list(Recorder.seen)
    assert_run_ok(proc, out)
    with open(out / "samples.csv", encoding="utf-8") as f:
        rows = {r["trace_id"]: r for r in csv.DictReader(f)}
    # Every request the server saw has its sample, which names its turn; those due in a step
    # say which.
    assert {r["trace_id"] for r in seen} <= rows.keys()
    for r in seen:
        row = rows[r["trace_id"]]
        assert int(row["turn"]) == _turn(r["messages"]), (row, r)
        assert row["session"] == ("failed" if r["failed"] else
                                  "completed" if row["turn"] == str(TURNS) else
                                  row["session"] and "abandoned"), (row, r)
        r["phase"] = row["phase"]
    yield json.loads((out / "report.json").read_text()), seen


def _turn(messages: list[dict[str, Any]]) -> int:
    return sum(m["role"] == "user" for m in messages)


@pytest.mark.timeout(150)
def test_each_turn_sends_the_shared_prefix_and_the_answers_received(
        recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    _, seen = recorded
    assert len(seen) >= 20
    # Every first turn's history is the same: a request is its history and its answer.
    by_answer = {(json.dumps(r["messages"]), r["answer"]): r for r in seen}
    turns = [_turn(r["messages"]) for r in seen]
    assert set(turns) == set(range(1, TURNS + 1)), turns
    for r in seen:
        messages = r["messages"]
        k = _turn(messages)
        # The shared prefix first, then user and assistant in turn, the k-th prompt last.
        assert messages[0] == {"role": "system", "content": SYSTEM}
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * (k - 1) + ["user"]
        assert [m["content"] for m in messages[1::2]] == list(PROMPTS[:k])
        if k == 1:
            continue
        # The turn before sent exactly this history less the last exchange, and the answer
        # this turn sends back is the one the server streamed to it, as received.
        assert messages[-2]["role"] == "assistant"
        before = by_answer.get((json.dumps(messages[:-2]), messages[-2]["content"]))
        assert before is not None, messages
        assert not before["failed"]


@pytest.mark.timeout(150)
def test_a_failed_turn_ends_its_session_and_the_turns_and_sessions_add_up(
        recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    report, seen = recorded
    failed = [r for r in seen if r["failed"]]
    assert failed, "no second turn was failed"
    # No request continued a failed turn's history.
    failed_histories = {json.dumps(r["messages"]) for r in failed}
    for r in seen:
        assert json.dumps(r["messages"][:-2]) not in failed_histories
    # A request due after the last step (a closed loop's request may start a hair after its
    # end) is in no step; the rest are in the report.
    scored = [r for r in seen if r["phase"]]
    assert len(scored) >= len(seen) - 4
    sent = {k: sum(_turn(r["messages"]) == k for r in scored) for k in range(1, TURNS + 1)}
    failed = [r for r in scored if r["failed"]]
    phases = report["phases"]
    convs = [p["stats"]["conversation"] for p in phases if "conversation" in p["stats"]]
    assert len(convs) == 3
    ttft = {k: sum(c["turns"].get(str(k), {}).get("ttft_ms", {}).get("count", 0)
                   for c in convs) for k in range(1, TURNS + 1)}
    # Each turn number's TTFTs are the requests of that turn (the failed ones had none).
    assert ttft[1] == sent[1]
    assert ttft[2] == sent[2] - len(failed)
    assert ttft[3] == sent[3]
    assert sent[3] <= sent[2] - len(failed) and sent[2] <= sent[1]
    ends = {e: sum(c["sessions"][e] for c in convs) for e in ("completed", "failed",
                                                              "abandoned")}
    assert ends["failed"] == len(failed)
    # Every session began with a first turn and ended one way; the completed ones are the
    # last turns answered, the abandoned ones those the run's end came first for. A session
    # whose last turn started a hair after the last step is in no step's count.
    assert ends["completed"] == sent[3]
    assert sent[1] - (len(seen) - len(scored)) <= sum(ends.values()) <= sent[1]
    for p in phases:
        if "conversation" in p["stats"]:
            stats, cls = p["stats"], p["classes"]["chat"]
            assert cls["conversation"] == stats["conversation"]
            assert stats["conversation"]["sessions"]["failed"] == stats["errors"]["http_status"]


def _bad(tmp_path: Path, target: str, conversation: str, extra: str = "") -> list[str]:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\n"
        f"target: {target}\n"
        "load:\n"
        "  classes:\n"
        "    - name: chat\n"
        f"      conversation: {conversation}\n"
        f"{extra}"
        "phases: {baseline: 2s, fault: 2s, recovery: 2s}\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return [p.removeprefix(f"{path}:") for p in info.value.problems]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("target", "conversation", "where", "says"), [
    ("{protocol: openai, embedded: {}}", "{turns: 0}", "6:22: load.classes.0.conversation.turns:",
     "1"),
    ("{protocol: openai, embedded: {}}", "{turns: 3, system_prefix: 0 tokens}",
     "6:32: load.classes.0.conversation.system_prefix:", "1 to 100000 tokens"),
    ("{protocol: openai, embedded: {}}", "{turns: 3, think_time: {min: 2s, max: 1s}}",
     "6:32: load.classes.0.conversation.think_time:", "'max' must not be smaller"),
    ("{protocol: openai, embedded: {}}", "{turns: 3, think: 1s}",
     "6:32: load.classes.0.conversation.think:", "think_time"),
    ("{protocol: llama_cpp, embedded: {}}", "{turns: 3}",
     "6:7: load.classes.0.conversation:", "'llama_cpp' requests take one prompt"),
    ("{protocol: sse, embedded: {}}", "{turns: 3}",
     "6:7: load.classes.0.conversation:", "formats with one: openai, anthropic"),
    ("{protocol: openai, path: /v1/completions, embedded: {}}", "{turns: 3}",
     "6:7: load.classes.0.conversation:", "legacy completions"),
])
def test_bad_conversations_are_located(tmp_path: Path, target: str, conversation: str,
                                       where: str, says: str) -> None:
    problems = _bad(tmp_path, target, conversation)
    assert len(problems) == 1, problems
    assert problems[0].startswith(where), problems
    assert says in problems[0], problems


@pytest.mark.timeout(10)
def test_a_conversation_with_a_whole_body_is_refused_where_it_is(tmp_path: Path) -> None:
    problems = _bad(tmp_path, "{protocol: openai, embedded: {}}", "{turns: 2}",
                    '      body: {messages: [{role: user, content: "hi"}]}\n')
    assert len(problems) == 1, problems
    assert problems[0].startswith("6:7: load.classes.0.conversation:"), problems
    assert "'body'" in problems[0], problems


CACHED = """\
name: conversations-cache
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: 20ms
    itl: 2ms
    output_tokens: {min: 12, max: 12}
    prefix_cache: {slots: 8, prefill_per_token: 0.5ms}
    seed: 4
  timeout: 10s
  probe: false
load:
  users: 4
  think_time: {min: 10ms, max: 30ms}
  classes:
    - name: chat
      max_tokens: 12
      prompts: ["How do I reset the router?", "It did not help.", "What next?"]
      conversation: {turns: 3, think_time: 20ms, system_prefix: 300 tokens}
  seed: 9
faults:
  - {type: cache_flush, name: flush, every: 50ms}
steps:
  - {name: warm, kind: warmup, duration: 1s}
  - {name: before, kind: baseline, duration: 3s}
  - {name: flush, kind: fault, duration: 3s, faults: [flush]}
  - {name: after, kind: recovery, duration: 3s}
"""


@pytest.mark.timeout(150)
def test_a_cache_flush_shows_as_lost_prefix_reuse_and_longer_ttft_of_later_turns(
        tmp_path: Path) -> None:
    """Against the embedded target's prefix cache, which says what it reused in llama-server's
    ``timings.cache_n``: before the flush a turn reads only what is new since the turn before;
    in it every turn reads its whole history; after it the reuse is back."""
    scenario = tmp_path / "cached.yaml"
    scenario.write_text(CACHED)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=120)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    by = {p["name"]: p["stats"] for p in report["phases"]}
    reuse = {name: by[name]["prompt_cache_reuse"] for name in ("before", "flush", "after")}
    assert reuse["before"] > 0.8 and reuse["after"] > 0.8, reuse
    assert reuse["flush"] < 0.5 * reuse["before"], reuse
    last = {name: by[name]["conversation"]["turns"]["3"]["ttft_ms"]["p50"]
            for name in ("before", "flush", "after")}
    # The flush's later turns read their ~330 words again (0.5 ms each): far longer.
    assert last["flush"] > last["before"] + 100 and last["flush"] > last["after"] + 100, last
    summary = (out / "summary.md").read_text()
    assert "| prompt tokens from cache |" in summary
    assert "| sessions done/failed/abandoned |" in summary


@pytest.mark.timeout(10)
def test_the_client_reads_llama_servers_timings_in_both_its_formats() -> None:
    # llama-server's last event of an OpenAI chat stream, and of its native /completion one
    # (shapes as llama-server b4000+ sends them), with the prompt's account in `timings`.
    timings = {"cache_n": 394, "prompt_n": 1, "prompt_ms": 0.9, "predicted_n": 8}
    chat = {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
            "created": 1, "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk",
            "timings": timings}
    native = {"content": "", "stop": True, "stop_type": "eos", "tokens_predicted": 8,
              "model": "m", "timings": timings}
    cases: tuple[tuple[Protocol, dict[str, Any]], ...] = (("openai", chat), ("llama_cpp", native))
    for protocol, obj in cases:
        decoded = decode(protocol, SSEEvent(data=json.dumps(obj)))
        assert (decoded.cache_n, decoded.prompt_n) == (394, 1), protocol
        bare = {k: v for k, v in obj.items() if k != "timings"}
        decoded = decode(protocol, SSEEvent(data=json.dumps(bare)))
        assert (decoded.cache_n, decoded.prompt_n) == (None, None), protocol


@pytest.mark.timeout(10)
@pytest.mark.parametrize("protocol", HISTORY_FORMATS)
def test_each_format_with_a_history_writes_one_its_server_reads_whole(
        protocol: Protocol) -> None:
    # The history as the embedded target's parser for the format reads it: every prompt and
    # answer, and the system prefix, in the text it prices.
    wire = get(protocol)
    turns = [("first question", "first answer"), ("second question", "second answer")]
    body = with_history(protocol, wire.body("sim-1", "ignored", 16), "the shared prefix",
                        turns, "third question")
    text = wire.parse(json.loads(json.dumps(body)), "sim-1").prompt
    for part in ("the shared prefix", "first question", "first answer", "second question",
                 "second answer", "third question"):
        assert part in text, (protocol, part, text)
    assert "ignored" not in text
