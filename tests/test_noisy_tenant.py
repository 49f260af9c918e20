"""The engine family's noisy tenant (issue 32): ``noisy_tenant`` sends another tenant's long
streams to the target for its step, from the run's own process, so the scenario's class is
judged while the target serves them too.

Through the real CLI against the embedded target (4 streams at once, the rest queued): the
class's TTFT rises in the fault step over the same run's baseline and comes back after; the
fault counts what it sent, and the target's own send log shows its streams served and none of
them among the scenario's samples. Bad settings are located; a target the tenant cannot reach or
that refuses its requests stops the run before any load, naming the fault; and a run SIGKILLed
while the tenant streams leaves no stream open at the target.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.faults.contract import RunContext
from streamquake.faults.engine.spec import NoisyTenantFault
from streamquake.faults.engine.tenant import NoisyTenantInjector
from streamquake.journal import Journal
from tests.conftest import REPO, cli_cmd, free_port, run_cli
from tests.engines.llama_server import EXACT_LENGTH, LlamaServer, llama_server
from tests.engines.tap import Exchange, Tap
from tests.helpers import assert_run_ended, wait_for_line
from tests.timing import wait_until

__all__ = ["llama_server"]   # the session fixture

TOKENS = 120                 # every answer of the target's; the class asks for 16 of them
ASKED = 16
TARGET = ("{{protocol: openai, model: sim-1, timeout: 20s, embedded: {{ttft: 30ms, itl: 8ms, "
          "output_tokens: {{min: {t}, max: {t}}}, capacity: 4, seed: 32{extra}}}}}")
SCENARIO = """name: noisy-tenant-test
target: {target}
load:
  users: 3
  think_time: {{min: 100ms, max: 200ms}}
  classes:
    - {{name: chat, prompt: "Summarise the release notes in two sentences.", max_tokens: {asked}}}
  seed: 32
faults:
  - {fault}
steps:
{steps}
"""
STEPS = """  - {name: warm, kind: warmup, duration: 1s}
  - {name: before, kind: baseline, duration: 4s}
  - {name: noise, kind: fault, duration: 4s, faults: [tenant]}
  - {name: after, kind: recovery, duration: 4s}"""
FAULT = "{type: noisy_tenant, name: tenant, concurrency: 6, prompt_tokens: 2000}"


def _scenario(path: Path, target: str, fault: str = FAULT, steps: str = STEPS) -> Path:
    path.write_text(SCENARIO.format(target=target, asked=ASKED, fault=fault, steps=steps))
    return path


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Path]:
    tmp = tmp_path_factory.mktemp("noisy")
    send_log = tmp / "send.jsonl"
    target = TARGET.format(t=TOKENS, extra=f", send_log: '{send_log}'")
    out = tmp / "out"
    done = run_cli("run", str(_scenario(tmp / "noisy.yaml", target)), "--out", str(out),
                   "--no-watchdog", timeout=120,
                   env={"STREAMQUAKE_STATE_DIR": str(tmp / "state")})
    assert_run_ended(done)
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report, out, send_log


def _step(report: dict[str, Any], name: str) -> dict[str, Any]:
    step: dict[str, Any] = next(p for p in report["phases"] if p["name"] == name)
    return step


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_tenant_raises_ttft_in_its_step_only(
        noisy_run: tuple[dict[str, Any], Path, Path]) -> None:
    report, _, _ = noisy_run
    ttft = {name: _step(report, name)["stats"]["ttft_ms"] for name in ("before", "noise", "after")}
    for name, stats in ttft.items():
        assert stats["count"] >= 5, (name, stats)
        assert _step(report, name)["stats"]["error_rate"] == 0, name
    # In the noise step a user's request queues for one of the 4 slots behind the tenant's 6
    # streams of 120 tokens (about a second each): its TTFT is that wait, many times the
    # baseline's. After revert closes them, the slots are the users' again.
    for q in ("p50", "p95"):
        rise = ttft["noise"][q] - ttft["before"][q]
        assert ttft["noise"][q] > 4 * ttft["before"][q], (q, ttft)
        assert ttft["after"][q] - ttft["before"][q] < 0.1 * rise, (q, ttft)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_tenant_counts_its_streams_and_none_is_a_sample(
        noisy_run: tuple[dict[str, Any], Path, Path]) -> None:
    report, out, send_log = noisy_run
    (record,) = report["faults"]
    assert record["error"] is None and record["phase"] == "noise", record
    applied, done = record["applied"], record["reverted"]
    assert applied["protocol"] == "openai" and applied["concurrency"] == 6, applied
    assert applied["url"].endswith("/v1/chat/completions"), applied
    assert done["load"] == "stopped" and done["errors"] == 0, done
    # 4 s of 6 streams on 4 slots at ~1 s a stream: about 20 served whole, 6 closed at revert.
    assert done["streams_completed"] >= 4, done
    assert done["streams_closed_at_revert"] == done["open_at_revert"] == 6, done
    assert done["requests_sent"] == done["streams_completed"] + done["streams_closed_at_revert"]
    assert done["tokens_received"] >= TOKENS * done["streams_completed"], done
    assert done["bytes_received"] > done["tokens_received"] * 10, done

    with (out / "samples.csv").open() as f:
        samples = list(csv.DictReader(f))
    sample_ids = {s["response_id"] for s in samples}
    assert len(sample_ids) == len(samples) and "" not in sample_ids
    lines = [json.loads(line) for line in send_log.read_text().splitlines()]
    served = {line["id"]: line for line in lines}
    assert sample_ids <= set(served)
    # The tenant's requests carry no traceparent, the load generator's (the run's probe's too)
    # a fresh one each: the target logs its trace id.
    theirs = sorted((line for line in lines if line["trace_id"] is None),
                    key=lambda line: line["index"])
    assert not {line["id"] for line in theirs} & sample_ids
    probes = [line for line in lines if line["id"] not in sample_ids and line["trace_id"]]
    assert len(probes) == 1, probes                 # the run's probe, one per class
    # First the tenant's preflight (one short stream, its head read), then its long streams:
    # whole answers of 120 tokens, which no user asked for (each asked for 16), and those
    # closed at revert, cut short or still queued.
    preflight, streams = theirs[0], theirs[1:]
    assert sum(preflight["content"]) <= 1, preflight
    assert len(streams) == done["requests_sent"], (len(streams), done)
    whole = [line for line in streams if sum(line["content"]) == TOKENS and line["complete"]]
    assert len(whole) == done["streams_completed"], (len(whole), done)
    cut = [line for line in streams if not line["complete"]]
    assert len(cut) == done["streams_closed_at_revert"], cut
    assert all(sum(served[i]["content"]) == ASKED for i in sample_ids)


BAD = """name: bad-tenant
target: {protocol: openai, embedded: {}}
load: {users: 1}
phases: {baseline: 2s, fault: 2s, recovery: 2s}
faults:
  - {type: noisy_tenant, name: a, concurrency: 0}
  - {type: noisy_tenant, name: b, rate: fast}
  - {type: noisy_tenant, name: c, prompt_tokens: 0}
  - {type: noisy_tenant, name: d, path: v1/chat}
  - {type: noisy_tenant, name: e, url: "ftp://127.0.0.1:8080"}
  - {type: noisy_tenant, name: f, timeout: 0s}
  - {type: noisy_tenant, name: g, protocol: grpc}
  - {type: noisy_tenant, name: h, concurency: 4}
"""


@pytest.mark.timeout(60)
def test_bad_settings_are_located_with_their_fix(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    done = run_cli("validate", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    said, where = done.stderr, str(path)
    for line, field, words in [
        (6, "faults.0.concurrency", "greater than or equal to 1"),
        (7, "faults.1.rate", "expected a rate like '10/s' or '600/m', got 'fast'"),
        (8, "faults.2.prompt_tokens", "greater than or equal to 1"),
        (9, "faults.3.path", "'v1/chat' must start with '/', e.g. /v1/chat/completions"),
        (10, "faults.4.url", "'ftp://127.0.0.1:8080' is not an http(s) URL with a host: write "
             "the target's base URL, e.g. http://127.0.0.1:8000"),
        (11, "faults.5.timeout", "must be above 0 and at most 600s, e.g. '30s'"),
        (12, "faults.6.protocol", "'openai'"),
        (13, "faults.7.concurency", "did you mean 'concurrency'?"),
    ]:
        located = f"{where}:{line}:"
        hit = [s for s in said.splitlines() if located in s and f" {field}: " in s]
        assert hit and words in hit[0], (located, field, words, said)


@pytest.mark.timeout(90)
def test_a_target_it_cannot_reach_or_that_refuses_it_stops_the_run_naming_the_fault(
        tmp_path: Path) -> None:
    closed = free_port()
    target = TARGET.format(t=8, extra="")
    scenario = tmp_path / "refused.yaml"
    scenario.write_text(SCENARIO.format(
        target=target, asked=8, steps=STEPS.replace("faults: [tenant]", "faults: [gone, lost]"),
        fault=(f"{{type: noisy_tenant, name: gone, url: 'http://127.0.0.1:{closed}', "
               "timeout: 2s}\n  - {type: noisy_tenant, name: lost, path: /v1/nowhere}")))
    done = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), "--no-watchdog",
                   timeout=80)
    said = done.stdout + done.stderr
    assert done.returncode == 3, said
    assert (f"fault 'gone' (noisy_tenant): cannot reach the target at http://127.0.0.1:{closed}"
            "/v1/chat/completions (Connection refused)") in said, said
    assert "fault 'lost' (noisy_tenant): the target at " in said, said
    assert "/v1/nowhere refused the tenant's openai request: HTTP 404" in said, said
    assert not (tmp_path / "out" / "samples.csv").exists()


def _established(port: int, pid: int | None = None) -> int:
    """TCP connections in ESTABLISHED state to ``port``: with ``pid``, the client ends that
    process holds; without, the server ends (the target's side)."""
    inodes: set[str] = set()
    if pid is not None:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            end = remote if pid is not None else local
            if (state == "01" and int(end.rsplit(":", 1)[1], 16) == port
                    and (pid is None or inode in inodes)):
                count += 1
    return count


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_killed_while_the_tenant_streams_leaves_no_stream_open(
        tmp_path: Path, state_dir: Path) -> None:
    """The target is the test's own process, so it outlives the run: the run's process holds
    the tenant's 8 streams open to it, and after the run's SIGKILL the target holds no
    connection open: the streams were threads of the run, and the kernel closed their sockets
    with it."""
    config = TargetConfig.model_validate({"ttft": "30ms", "itl": "20ms", "capacity": 64,
                                          "output_tokens": {"min": 5000, "max": 5000}})
    with start_target(config, log_path=tmp_path / "target.log") as served:
        port = int(served.url.rsplit(":", 1)[1])
        target = f'{{protocol: openai, model: sim-1, url: "{served.url}", timeout: 10s}}'
        scenario = tmp_path / "kill.yaml"
        scenario.write_text(SCENARIO.format(
            target=target, asked=4,
            fault="{type: noisy_tenant, name: tenant, concurrency: 8, timeout: 5s}",
            steps="""  - {name: before, kind: baseline, duration: 1s}
  - {name: noise, kind: fault, duration: 120s, faults: [tenant]}""").replace(
                "{min: 100ms, max: 200ms}", "{min: 60s, max: 60s}"))
        proc = subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out"),
                                        "--no-watchdog"),
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            wait_for_line(proc, "fault applied", timeout_s=90)
            journal = json.loads((state_dir / "journal.json").read_text())
            (entry,) = [e for e in journal if e["type"] == "noisy_tenant"]
            pid = entry["state"]["pid"]       # the process the tenant's threads live in
            assert pid == proc.pid, entry
            wait_until(lambda: _established(port, pid) == 8,
                       "the tenant's 8 streams to be open", timeout_s=30)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        wait_until(lambda: _established(port) == 0, "the target to see every stream closed",
                   timeout_s=30)
        journal = json.loads((state_dir / "journal.json").read_text())
        assert [e["type"] for e in journal] == ["noisy_tenant"], journal
        done = run_cli("recover")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ended with it (its sockets closed)" in done.stdout, done.stdout
        assert json.loads((state_dir / "journal.json").read_text()) == []


def _tenant(url: str, tmp_path: Path, **settings: object) -> NoisyTenantInjector:
    spec = NoisyTenantFault.model_validate({"type": "noisy_tenant", "name": "t", "url": url,
                                            "protocol": "openai", **settings})
    return NoisyTenantInjector(spec, RunContext(target_host="", target_port=0,
                                                run_dir=tmp_path))


@pytest.mark.timeout(60)
def test_a_rate_sends_no_more_than_its_arrivals_and_revert_closes_streams_at_once(
        tmp_path: Path, state_dir: Path) -> None:
    """The injector alone against a target process: with `rate`, arrivals never run ahead of
    the clock, and those due while every stream is busy are skipped and counted; revert ends
    streams that had 20 s left, and the target holds none open after."""
    config = TargetConfig.model_validate({"ttft": "5ms", "itl": "20ms", "capacity": 64,
                                          "output_tokens": {"min": 1, "max": 1}})
    with start_target(config, log_path=tmp_path / "fast.log") as served:
        tenant = _tenant(served.url, tmp_path, rate="20/s", concurrency=4, max_tokens=1)
        assert tenant.preflight() == []
        tenant.apply(Journal().add("noisy_tenant", "t"))
        time.sleep(1.0)
        done = tenant.revert()
    assert done["errors"] == 0 and "ending" not in done, done
    # Never more than the schedule allowed (one at apply, then one each 50 ms), and most of it.
    assert 5 <= done["requests_sent"] <= int(done["ran_s"] * 20) + 1, done
    assert done["streams_completed"] >= done["requests_sent"] - 4, done

    config = TargetConfig.model_validate({"ttft": "5ms", "itl": "20ms", "capacity": 64,
                                          "output_tokens": {"min": 1000, "max": 1000}})
    with start_target(config, log_path=tmp_path / "slow.log") as served:
        port = int(served.url.rsplit(":", 1)[1])
        tenant = _tenant(served.url, tmp_path, rate="20/s", concurrency=2, timeout="5s")
        tenant.apply(Journal().add("noisy_tenant", "t"))
        wait_until(lambda: _established(port) == 2, "the tenant's 2 streams to be open")
        time.sleep(0.5)
        started = time.monotonic()
        done = tenant.revert()
        took = time.monotonic() - started
        # Both streams had about 20 s to go; revert shut their sockets and both threads ended
        # (within a quarter of that, however busy the machine).
        assert "ending" not in done and took < 5.0, (took, done)
        assert done["requests_sent"] == 2 == done["streams_closed_at_revert"], done
        assert done["streams_completed"] == 0 and done["arrivals_skipped"] >= 5, done
        assert done["tokens_received"] > 0 and done["bytes_received"] > 0, done
        wait_until(lambda: _established(port) == 0, "the target to see both streams closed")
        assert tenant.revert()["requests_sent"] == 2         # idempotent: nothing more sent


@pytest.mark.timeout(30)
def test_a_key_in_the_targets_path_is_sent_but_never_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemini's key rides in the path's query (``?key=${VAR}``): the tenant's requests carry it,
    and what it says (preflight's sentences, the journal, its record and description) shows
    the path as the scenario wrote it."""
    from streamquake.faults.engine.tenant import ScenarioTarget

    secret = "sq-tenant-secret-7f3a9c"
    monkeypatch.setenv("SQ_TENANT_KEY", secret)
    view = ScenarioTarget("gemini", "gemini-x", "/v1beta/models/gemini-x:streamGenerateContent"
                          "?alt=sse&key=${SQ_TENANT_KEY}", {}, True, url="http://127.0.0.1:9")
    spec = NoisyTenantFault.model_validate({"type": "noisy_tenant", "name": "t"})
    tenant = NoisyTenantInjector(spec, RunContext(target_host="", target_port=0,
                                                  run_dir=tmp_path, resources=[view]))
    req = tenant.request()
    assert req.url.endswith(f"key={secret}") and req.shown.endswith("key=${SQ_TENANT_KEY}")
    said = tenant.preflight()              # nothing listens on port 9
    assert said and "${SQ_TENANT_KEY}" in said[0], said
    assert secret not in json.dumps([said, tenant.describe()]), said


# -- against llama-server ------------------------------------------------------------------------

LLAMA_STEPS = """  - {name: warm, kind: warmup, duration: 2s}
  - {name: before, kind: baseline, duration: 5s}
  - {name: noise, kind: fault, duration: 12s, faults: [tenant]}
  - {name: after, kind: recovery, duration: 6s}"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_on_llama_server_the_tenants_long_prompts_take_its_slots_in_its_step_only(
        tmp_path: Path, llama_server: LlamaServer) -> None:
    """llama-server with 4 slots on one thread, a relay recording the wire in front of it: the
    tenant's 3 streams of long prompts hold 3 slots in its step and share the
    engine's batch, so the class's 3 users wait for a slot, or for their turn in the batch, and
    their TTFT rises, there only. The engine's own account on the wire says
    which requests were the tenant's (its prompt tokens, read anew) and none of them is a
    sample."""
    port = int(llama_server.url.rsplit(":", 1)[1])
    body = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 16,
            **EXACT_LENGTH}
    fault = "{type: noisy_tenant, name: tenant, concurrency: 3, prompt_tokens: 100, " \
            "max_tokens: 20}"
    with Tap(port) as tap:
        scenario = tmp_path / "noisy-llama.yaml"
        scenario.write_text(f"""name: noisy-tenant-llama-server
target: {{protocol: openai, model: tiny, url: "{tap.url}", timeout: 30s}}
load:
  users: 3
  think_time: {{min: 50ms, max: 150ms}}
  classes:
    - {{name: chat, body: {json.dumps(body)}}}
  seed: 32
faults:
  - {fault}
steps:
{LLAMA_STEPS}
""")
        out = tmp_path / "out"
        done = run_cli("run", str(scenario), "--out", str(out), "--no-watchdog", timeout=150)
        assert_run_ended(done)
        exchanges = list(tap.exchanges())
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    (record,) = report["faults"]
    assert record["error"] is None, record
    sent = record["reverted"]
    print("\ntenant:", json.dumps(sent))
    ttft = {name: _step(report, name)["stats"]["ttft_ms"] for name in ("before", "noise", "after")}
    print("class TTFT p50:", {name: t["p50"] for name, t in ttft.items()},
          "count:", {name: t["count"] for name, t in ttft.items()})
    for name, stats in ttft.items():
        assert stats["count"] >= 3, (name, stats)
    rise = ttft["noise"]["p50"] - ttft["before"]["p50"]
    assert ttft["noise"]["p50"] > 3 * ttft["before"]["p50"], ttft
    assert ttft["after"]["p50"] - ttft["before"]["p50"] < 0.2 * rise, ttft
    # The tenant's: sent by the fault, streamed by the engine, and never a sample.
    assert sent["errors"] == 0 and sent["streams_completed"] >= 1, sent
    assert sent["requests_sent"] == sent["streams_completed"] + sent["streams_closed_at_revert"]
    with (out / "samples.csv").open() as f:
        sample_ids = {s["response_id"] for s in csv.DictReader(f)}
    # Every request the relay carried is a sample's, the run's probe of the class, the tenant's
    # preflight (one token) or one of its long streams (some still queued at revert).
    long_prompts = [ex for ex in exchanges if ex.request.get("max_tokens") == 20]
    assert len(long_prompts) == sent["requests_sent"], (len(long_prompts), sent)
    answered = {ex.events[0].json["id"]: ex for ex in exchanges if ex.status == 200 and ex.events}
    ours = [ex for rid, ex in answered.items() if rid in sample_ids]
    assert len(ours) == len(sample_ids - {""}), (len(ours), len(sample_ids))
    assert not {id(ex) for ex in ours} & {id(ex) for ex in long_prompts}
    counted = {id(ex) for ex in ours + long_prompts}
    rest = [ex.request for ex in exchanges if id(ex) not in counted]
    preflight = [r for r in rest if r.get("max_tokens") == 1]
    probe = [r for r in rest if r["messages"] == body["messages"]]   # the run's, of the class
    assert len(preflight) == len(probe) == 1 and len(rest) == 2, rest

    # Whole answers end with the engine's timings: the prompts it read are the tenant's long
    # ones, many times the class's.
    def prompt_n(exs: list[Exchange]) -> list[int]:
        return [ex.events[-2].json["timings"]["prompt_n"] + ex.events[-2].json["timings"].get(
            "cache_n", 0) for ex in exs if ex.events and ex.events[-1].data == "[DONE]"]
    assert prompt_n(long_prompts) and prompt_n(ours), (len(long_prompts), len(ours))
    print("prompt tokens, the tenant's:", sorted(set(prompt_n(long_prompts))),
          "the class's:", sorted(set(prompt_n(ours))))
    assert min(prompt_n(long_prompts)) > 5 * max(prompt_n(ours)), (
        prompt_n(long_prompts)[:5], prompt_n(ours)[:5])
