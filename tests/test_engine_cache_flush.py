"""The engine family's cache flush (issue 32): ``cache_flush`` erases the serving engine's KV
cache through llama-server's slots API, once or on a period, for its step only.

Against the embedded target's ``prefix_cache`` (its slots API and llama-server's ``timings``)
and against a real ``llama-server`` (tests/engines/), through the real CLI: the flush step's
TTFT rises over the baseline of the same run and comes back after; on llama-server the engine's
own ``timings`` (read off the wire by a relay, tests/engines/tap.py) show the cache lost in the
flush step only. A server without the API is refused before any load, bad settings are located,
and a run SIGKILLed while it flushes leaves nothing flushing.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.reports.csv_report import read_samples
from tests.conftest import REPO, cli_cmd, run_cli
from tests.engines.llama_server import EXACT_LENGTH, LlamaServer, llama_server, serve
from tests.engines.tap import Tap
from tests.helpers import assert_run_ended, wait_for_line
from tests.timing import wait_until

__all__ = ["llama_server"]     # the session fixture: llama-server as the suite starts it

# One long prompt every request shares (about 120 words): cached, a request reads one token of
# it again; flushed, all of them.
PROMPT = (
    "You are the support assistant of a company that sells network equipment to small offices. "
    "Answer in plain words, in at most three sentences, and never guess a price or a delivery "
    "date: say that a person will follow up instead. When a question is about configuration, "
    "name the menu and the setting, and say whether a restart is needed. When a question is "
    "about a fault, ask first for the model, the firmware version and what the status light "
    "shows, then suggest one step at a time, starting with the least disruptive one. The "
    "customer asks: my router drops the connection every evening around eight; what should I "
    "check first?")
WORDS = len(PROMPT.split())
CACHE = {"slots": 4, "prefill_per_token": "2ms"}


def _http(method: str, url: str, body: dict[str, Any] | None = None
          ) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    if method == "POST" and data is None:
        data = b""
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def _chat(url: str, prompt: str = PROMPT) -> tuple[float, dict[str, Any]]:
    """One streamed chat request: (its TTFT in ms, its last chunk before [DONE])."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent, first, events = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=30) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content")
                                     for c in chunk.get("choices", [])):
                first = time.perf_counter()
            events.append(chunk)
    assert first is not None, events
    return (first - sent) * 1000, events[-1]


@pytest.fixture
def cached_target() -> Iterator[TargetProcess]:
    """The embedded target with a prefix cache, as a process of its own (it outlives a run)."""
    cfg = TargetConfig.model_validate({"ttft": "20ms", "itl": "2ms", "prefix_cache": CACHE,
                                       "output_tokens": {"min": 4, "max": 4}})
    with start_target(cfg, host="127.0.0.1") as target:
        yield target


def _slots(url: str) -> list[dict[str, Any]]:
    status, text = _http("GET", f"{url}/slots")
    assert status == 200, text
    listed: list[dict[str, Any]] = json.loads(text)
    return listed


# -- the embedded target's prefix cache ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_embedded_targets_prefix_cache_is_flushed_through_the_slots_api(
        cached_target: TargetProcess) -> None:
    url = cached_target.url
    cold_ms, cold = _chat(url)
    warm_ms, warm = _chat(url)
    # llama-server's account: every prompt token read the first time, then only the last one.
    assert cold["timings"]["prompt_n"] == WORDS and cold["timings"]["cache_n"] == 0, cold
    assert warm["timings"]["prompt_n"] == 1 and warm["timings"]["cache_n"] == WORDS - 1, warm
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": WORDS - 1}, warm
    held = [s for s in _slots(url) if s["n_prompt_tokens"]]
    assert [s["n_prompt_tokens"] for s in held] == [WORDS], _slots(url)
    status, text = _http("POST", f"{url}/slots/{held[0]['id']}?action=erase")
    assert status == 200 and json.loads(text) == {"id_slot": held[0]["id"], "n_erased": WORDS}
    flushed_ms, flushed = _chat(url)
    assert flushed["timings"]["prompt_n"] == WORDS and flushed["timings"]["cache_n"] == 0
    # The prefill is priced per uncached token (2 ms each, about 0.2 s here): the flushed request
    # pays it again, the cached one did not.
    assert flushed_ms - warm_ms > 0.5 * WORDS * 2, (cold_ms, warm_ms, flushed_ms)
    # llama-server's answers to what it does not take: an unknown action, a slot it lacks.
    assert _http("POST", f"{url}/slots/0")[0] == 400
    assert _http("POST", f"{url}/slots/0?action=save")[0] == 400
    assert _http("POST", f"{url}/slots/99?action=erase")[0] == 400
    # Off (the default), the target is as it was: no slots API, no timings, no prefill time.
    plain = TargetConfig.model_validate({"ttft": "20ms", "itl": "2ms",
                                         "output_tokens": {"min": 4, "max": 4}})
    with start_target(plain, host="127.0.0.1") as target:
        _, last = _chat(target.url)
        assert "timings" not in last and "prompt_tokens_details" not in last["usage"], last
        assert _http("GET", f"{target.url}/slots")[0] == 404


# -- bad settings ---------------------------------------------------------------------------------

BAD = """name: bad-flush
target: {protocol: openai, embedded: {prefix_cache: {slots: 2}}}
load: {users: 1}
phases: {baseline: 2s, fault: 2s, recovery: 2s}
faults:
  - {type: cache_flush, name: a, every: 5ms}
  - {type: cache_flush, name: b, slots: []}
  - {type: cache_flush, name: c, slots: [0, 0]}
  - {type: cache_flush, name: d, slots: [-1]}
  - {type: cache_flush, name: e, url: "ftp://127.0.0.1:8080"}
  - {type: cache_flush, name: f, timeout: 0s}
  - {type: cache_flush, name: g, every: 100ms, evry: 1s}
"""


@pytest.mark.timeout(60)
def test_bad_settings_are_located_with_their_fix(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    done = run_cli("validate", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stderr
    where = str(path)
    for line, col, field, words in [
        (6, 34, "faults.0.every", "must be at least 10ms (e.g. '250ms'); leave `every` out"),
        (7, 34, "faults.1.slots", "list at least one slot id (e.g. [0, 1]), or write 'all'"),
        (8, 34, "faults.2.slots", "a slot id is listed twice: list each once"),
        (9, 34, "faults.3.slots", "-1 is not a slot id: slot ids are whole numbers from 0"),
        (10, 34, "faults.4.url", "'ftp://127.0.0.1:8080' is not an http(s) URL with a host: "
                 "write the engine's base URL, e.g. http://127.0.0.1:8080"),
        (11, 34, "faults.5.timeout", "must be above 0 and at most 60s, e.g. '2s'"),
        (12, 48, "faults.6.evry", "unknown field (hint: did you mean 'every'?"),
    ]:
        located = f"{where}:{line}:{col}: {field}: {words}"
        assert located in said, (located, said)


# -- runs against the embedded target -------------------------------------------------------------


def _scenario(tmp_path: Path, target: str, fault: str, steps: str, users: int = 4,
              think: str = "{min: 50ms, max: 150ms}") -> Path:
    path = tmp_path / "flush.yaml"
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, **EXACT_LENGTH}
    path.write_text(f"""name: cache-flush
target: {target}
load:
  users: {users}
  think_time: {think}
  classes: [{{name: chat, body: {json.dumps(body)}}}]
  seed: 32
faults:
  - {fault}
steps:
{steps}
slos:
  - {{metric: error_rate, max: 1%}}
""")
    return path


STEPS = """  - {name: warm, kind: warmup, duration: 3s}
  - {name: before, kind: baseline, duration: 5s}
  - {name: flush, kind: fault, duration: 5s, faults: [flush]}
  - {name: after, kind: recovery, duration: 5s}"""
EMBEDDED = ("{protocol: openai, model: sim-1, timeout: 10s, embedded: {ttft: 30ms, itl: 5ms, "
            "output_tokens: {min: 8, max: 8}, prefix_cache: {slots: 4, prefill_per_token: 2ms}}}")


def _run(tmp_path: Path, scenario: Path) -> dict[str, Any]:
    out = tmp_path / "out"
    done = run_cli("run", str(scenario), "--out", str(out), "--no-watchdog", timeout=150)
    assert_run_ended(done)
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def _step(report: dict[str, Any], name: str) -> dict[str, Any]:
    step: dict[str, Any] = next(p for p in report["phases"] if p["name"] == name)
    return step


def _fault(report: dict[str, Any]) -> dict[str, Any]:
    (record,) = report["faults"]
    assert record["error"] is None, record
    fault: dict[str, Any] = record
    return fault


@pytest.mark.timeout(150)
def test_a_flush_raises_ttft_in_its_step_only_and_counts_its_erases(tmp_path: Path) -> None:
    report = _run(tmp_path, _scenario(tmp_path, EMBEDDED,
                                      "{type: cache_flush, name: flush, every: 100ms}", STEPS))
    ttft = {name: _step(report, name)["stats"]["ttft_ms"]
            for name in ("before", "flush", "after")}
    for name, stats in ttft.items():
        assert stats["count"] >= 5, (name, stats)
        assert _step(report, name)["stats"]["error_rate"] == 0, name
    # Each flushed request reads the whole prompt again (2 ms a word here): TTFT p50 in the flush
    # step is the baseline's plus most of that; after it, the cache refills and TTFT comes back.
    prefill_ms = WORDS * 2
    rise = ttft["flush"]["p50"] - ttft["before"]["p50"]
    assert rise > 0.6 * prefill_ms, ttft
    assert ttft["after"]["p50"] - ttft["before"]["p50"] < 0.25 * rise, ttft
    record = _fault(report)
    assert record["phase"] == "flush"
    assert record["applied"]["slots"] == [0, 1, 2, 3] and record["applied"]["every_ms"] == 100
    assert record["applied"]["first_flush"]["erased"] == 4, record["applied"]
    done = record["reverted"]
    assert done["flushing"] == "stopped" and done["erases_failed"] == 0, done
    # About 50 rounds of 4 slots in 5 s (at least a third, on a busy machine): each counted.
    assert done["erases_sent"] == done["erased"] >= 4 * 15, done
    assert done["flushes"] >= 15 and done["tokens_erased"] > 0, done
    assert "cannot be undone" in done["note"]


@pytest.mark.timeout(90)
def test_a_target_without_the_slots_api_is_refused_before_any_load(tmp_path: Path) -> None:
    plain = ("{protocol: openai, model: sim-1, timeout: 10s, embedded: {ttft: 30ms, itl: 5ms, "
             "output_tokens: {min: 8, max: 8}}}")
    scenario = _scenario(tmp_path, plain, "{type: cache_flush, name: flush, every: 100ms}",
                         STEPS)
    done = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), "--no-watchdog",
                   timeout=90)
    assert done.returncode == 3, done.stdout + done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "fault 'flush' (cache_flush): the target at http://127.0.0.1:" in said, said
    assert "exposes no slots API: GET /slots answered 404" in said, said
    assert "vLLM, TGI and SGLang expose no per-slot erase" in said, said
    assert "starting the load generator" not in said, said


# -- a run killed while it flushes ---------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_run_killed_while_flushing_leaves_nothing_flushing(
        tmp_path: Path, cached_target: TargetProcess, state_dir: Path) -> None:
    """The target is a process of the test's, so it outlives the run: its slots show whether
    anything still erases them. While the run holds the fault, a cache filled by hand is
    emptied within a few periods; after the run's SIGKILL, it stays filled."""
    url = cached_target.url
    target = (f'{{protocol: openai, model: sim-1, url: "{url}", timeout: 10s}}')
    steps = """  - {name: before, kind: baseline, duration: 1s}
  - {name: flush, kind: fault, duration: 120s, faults: [flush]}
  - {name: after, kind: recovery, duration: 1s}"""
    scenario = _scenario(tmp_path, target, "{type: cache_flush, name: flush, every: 50ms}",
                         steps, users=1, think="{min: 5s, max: 5s}")
    proc = subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out"),
                                    "--no-watchdog"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for_line(proc, "fault applied", timeout_s=90)

        def emptied() -> bool:
            _chat(url)                  # fills a slot; the flusher empties it within 50 ms
            time.sleep(0.3)
            return all(s["n_prompt_tokens"] == 0 for s in _slots(url))

        wait_until(emptied, "the run's flushing to empty a slot filled by hand", timeout_s=30)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    journal = json.loads((state_dir / "journal.json").read_text())
    assert [e["type"] for e in journal] == ["cache_flush"], journal
    # Nothing erases the cache any more: a slot filled now still holds its prompt 20 periods on.
    _chat(url)
    time.sleep(1.0)
    assert sorted(s["n_prompt_tokens"] for s in _slots(url))[-1] == WORDS, _slots(url)
    done = run_cli("recover")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a flush cannot be undone" in done.stdout, done.stdout
    assert "ended with the process that ran it" in done.stdout, done.stdout
    assert json.loads((state_dir / "journal.json").read_text()) == []


# -- against llama-server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def erasable_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama-server as the suite starts it, with --slot-save-path (without it, it refuses to
    erase a slot: 501) and --cache-ram 0: its second prompt cache, in host memory (8 GiB by
    default), keeps copies of the slots' prompts that an erase leaves, and a request restored
    from one reads no prompt anew (measured: the first second of a flush step so)."""
    work = tmp_path_factory.mktemp("llama-erasable")
    yield from serve(work, extra=("--slot-save-path", str(work), "--cache-ram", "0"))


def _timings_by_step(tap: Tap, report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The engine's ``timings`` of each answer the relay carried, by the step its request was
    sent in (a flushed answer may end in the next step: its prefill was in this one)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for ex in tap.exchanges():
        if ex.status != 200 or not ex.events or ex.events[-1].data != "[DONE]":
            continue
        last = ex.events[-2].json
        for p in report["phases"]:
            if p["start"] <= ex.request_t < p["end"]:
                out.setdefault(p["name"], []).append(last["timings"])
    return out


# A flushed request reads 395 tokens on one thread: 0.5 s to 1 s, and 2.5 s with every core
# busy (the first ones after the flush too, the cache empty), so the steps are longer here.
#
# One user at a time: llama-server defers the erase of a busy slot, and each slot released
# takes one deferred task back (llama.cpp's callback_on_release: the oldest deferred task in
# older builds, the one that asked for that slot in newer ones). With two users on a busy
# machine (scripts/test-stress, 12 busy loops) a user's next request reached its slot before
# that slot's erase did, again and again: the flush step read 1 prompt token anew at the
# median, as the steps around it, while the fault counted 32 erases done (reuse 0.60 against
# 1.00 before). With one user the released slot's erase is the only one deferred, and it runs
# first: the same load read the whole prompt anew in every flush-step request (reuse 0.00).
LLAMA_STEPS = """  - {name: warm, kind: warmup, duration: 3s}
  - {name: before, kind: baseline, duration: 5s}
  - {name: flush, kind: fault, duration: 10s, faults: [flush]}
  - {name: after, kind: recovery, duration: 8s}"""


@pytest.mark.timeout(240)
def test_on_llama_server_the_engines_own_timings_show_the_flush_in_its_step_only(
        tmp_path: Path, erasable_llama: LlamaServer) -> None:
    port = int(erasable_llama.url.rsplit(":", 1)[1])
    with Tap(port) as tap:
        # The load goes through the relay, which reads the engine's timings off the wire; the
        # fault talks to the engine directly.
        target = f'{{protocol: openai, model: tiny, url: "{tap.url}", timeout: 30s}}'
        # An erase of a busy slot waits for it: up to a flushed request's length, over 1 s here.
        fault = (f'{{type: cache_flush, name: flush, every: 100ms, timeout: 10s, '
                 f'url: "{erasable_llama.url}"}}')
        report = _run(tmp_path, _scenario(tmp_path, target, fault, LLAMA_STEPS, users=1,
                                          think="{min: 50ms, max: 150ms}"))
    by_step = _timings_by_step(tap, report)
    prompt_n = {name: statistics.median(t["prompt_n"] for t in by_step.get(name, [{}]))
                for name in ("before", "flush", "after")}
    cache_n = {name: statistics.median(t["cache_n"] for t in by_step[name])
               for name in ("before", "flush", "after")}
    counts = {name: len(by_step[name]) for name in prompt_n}
    assert min(counts.values()) >= 3, (counts, erasable_llama.log_tail())
    # Cached before and after: the engine reads a token or so of the prompt anew (the chat
    # template's few, the last one). Flushed: every token, nothing from the cache.
    assert prompt_n["flush"] > 10 * max(prompt_n["before"], prompt_n["after"], 1), prompt_n
    assert cache_n["flush"] < 0.1 * min(cache_n["before"], cache_n["after"]), cache_n
    ttft = {name: _step(report, name)["stats"]["ttft_ms"]["p50"] for name in prompt_n}
    assert ttft["flush"] > ttft["before"] and ttft["flush"] > ttft["after"], ttft
    # streamquake reads the same timings from each stream: request by request (joined by the
    # response's id) they are the wire's, and its reuse per step says what the engine did.
    wire = {ex.events[-2].json["id"]: ex.events[-2].json["timings"] for ex in tap.exchanges()
            if ex.status == 200 and len(ex.events) > 1 and ex.events[-1].data == "[DONE]"}
    read = [(s.response_id, s.cache_n, s.prompt_n)
            for s in read_samples(tmp_path / "out" / "run" / "samples")
            if s.error is None and s.response_id in wire]
    assert len(read) >= sum(counts.values()) - 2, (len(read), counts)
    assert all((cache, anew) == (wire[rid]["cache_n"], wire[rid]["prompt_n"])
               for rid, cache, anew in read), read
    reuse = {name: _step(report, name)["stats"]["prompt_cache_reuse"] for name in prompt_n}
    assert reuse["before"] > 0.8 and reuse["flush"] < reuse["before"], reuse
    record = _fault(report)
    done = record["reverted"]
    assert done["erases_failed"] == 0 and done["erased"] >= 4 * 5, done
    assert done["tokens_erased"] > 0, done


@pytest.mark.timeout(120)
def test_llama_server_without_slot_save_path_is_refused_with_its_own_words(
        tmp_path: Path, llama_server: LlamaServer) -> None:
    """The suite's llama-server lists its slots (GET /slots is on by default) but, started
    without --slot-save-path, refuses every action: the run stops before any load, saying so."""
    target = f'{{protocol: openai, model: tiny, url: "{llama_server.url}", timeout: 30s}}'
    scenario = _scenario(tmp_path, target, "{type: cache_flush, name: flush}", STEPS, users=1)
    done = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), "--no-watchdog",
                   timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "fault 'flush' (cache_flush): the target at " in said, said
    assert "lists its slots but will not erase them: POST /slots/0 answered 501" in said, said
    assert "start it with --slot-save-path DIR" in said, said


CONVERSATION = """name: conversations-llama-server
target: {{protocol: openai, model: tiny, url: "{url}", timeout: 30s, probe: false}}
load:
  users: 1
  think_time: {{min: 10ms, max: 30ms}}
  classes:
    - name: chat
      max_tokens: 8
      prompts: ["How do I reset the router?", "It did not help.", "What next?"]
      conversation: {{turns: 3, think_time: 20ms, system_prefix: 100 tokens}}
  seed: 9
faults:
  - {{type: cache_flush, name: flush, every: 100ms, timeout: 10s, url: "{url}"}}
steps:
{steps}
slos:
  - {{metric: error_rate, max: 5%}}
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_on_llama_server_a_conversations_prefix_reuse_is_lost_in_the_flush_step_only(
        tmp_path: Path, erasable_llama: LlamaServer) -> None:
    """Sessions of 3 turns whose history grows, against llama-server's own prefix cache: each
    turn finds the slot that holds its history and reads only what is new (the engine's
    ``timings.cache_n``, read by the client); a flush every 100 ms in the middle step takes that
    reuse away and the later turns read their whole history again; after it the reuse is back."""
    scenario = tmp_path / "conversations.yaml"
    # A 14 s flush step: under scripts/test-stress --hogs 4 an 8 s one saw only two third turns
    # (a flushed turn re-reads its whole history: p50 1.2 s there), too few to compare. One
    # user, as LLAMA_STEPS says why.
    steps = LLAMA_STEPS.replace("kind: fault, duration: 10s", "kind: fault, duration: 14s")
    assert steps != LLAMA_STEPS
    scenario.write_text(CONVERSATION.format(url=erasable_llama.url, steps=steps))
    report = _run(tmp_path, scenario)
    by = {p["name"]: p["stats"] for p in report["phases"]}
    reuse = {name: by[name]["prompt_cache_reuse"] for name in ("before", "flush", "after")}
    # The turns that carry a history (2 and 3), per step: a flushed one re-reads all of it.
    later = {turn: {name: by[name]["conversation"]["turns"][turn]["ttft_ms"] for name in reuse}
             for turn in ("2", "3")}
    print("\nprompt_cache_reuse:", reuse, "turn 2 and 3 TTFT p50:",
          {turn: {name: t["p50"] for name, t in steps.items()} for turn, steps in later.items()},
          "sessions:", {name: by[name]["conversation"]["sessions"] for name in reuse})
    # At least 3 such turns in each step (on a machine whose every core is busy, 12 busy loops,
    # the 14 s flush step held two sessions: two second and two third turns).
    assert all(sum(later[turn][name]["count"] for turn in later) >= 3 and
               all(later[turn][name]["count"] >= 1 for turn in later) for name in reuse), later
    assert reuse["before"] > 0.5 and reuse["after"] > 0.5, reuse
    assert reuse["flush"] < 0.5 * min(reuse["before"], reuse["after"]), reuse
    for steps in later.values():
        assert steps["flush"]["p50"] > max(steps["before"]["p50"], steps["after"]["p50"]), later
