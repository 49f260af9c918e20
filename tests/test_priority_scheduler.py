"""The embedded target's priority scheduler (``target.embedded.scheduler``) and a class's
``priority`` (vLLM's body field): waiting streams are admitted by priority, then arrival; a
priority's ``per_priority`` limit holds; a P0 evicts a stream still forming. Read through a real
target process (its send log and ``GET /scheduler``), and a real run under a P3 flood, once with
the scheduler and once without, compared with each other."""

from __future__ import annotations

import csv
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from statistics import fmean
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.errors import ScenarioError
from streamquake.scenario import load_scenario
from tests.conftest import run_cli
from tests.helpers import assert_run_ok, read_send_log

PATH = "/v1/chat/completions"


def _body(priority: int | None, tokens: int = 4) -> dict[str, object]:
    body: dict[str, object] = {"model": "sim-1", "stream": True, "max_tokens": tokens,
                               "messages": [{"role": "user", "content": "hi"}]}
    if priority is not None:
        body["priority"] = priority
    return body


def _post(url: str, body: dict[str, object]) -> tuple[int, bytes]:
    req = urllib.request.Request(url + PATH, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _report(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/scheduler", timeout=5) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _wait_for(what: Callable[[dict[str, Any]], bool], url: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not what(report := _report(url)):
        assert time.monotonic() < deadline, report
        time.sleep(0.01)


class Streams:
    """Requests sent from threads, each started once the target has it (running or queued), so
    the arrival order is the order sent."""

    def __init__(self, target: TargetProcess) -> None:
        self.url = target.url
        self.threads: list[threading.Thread] = []
        self.statuses: list[int] = []
        self.sent = 0

    def send(self, priority: int, tokens: int = 4) -> None:
        def go() -> None:
            self.statuses.append(_post(self.url, _body(priority, tokens))[0])

        self.threads.append(t := threading.Thread(target=go, daemon=True))
        t.start()
        self.sent += 1
        _wait_for(lambda r: r["streams"] >= self.sent, self.url)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=30)
        assert self.statuses == [200] * self.sent, self.statuses


def _config(log: Path, **scheduler: object) -> TargetConfig:
    return TargetConfig.model_validate({
        "ttft": "30ms", "itl": "10ms", "output_tokens": {"min": 100, "max": 100},
        "capacity": scheduler.pop("capacity", 1), "send_log": str(log), "seed": 3,
        "scheduler": {"policy": "priority", **scheduler}})


@pytest.mark.timeout(60)
def test_waiting_streams_are_admitted_by_priority_then_arrival(tmp_path: Path) -> None:
    log = tmp_path / "sends.jsonl"
    with start_target(_config(log)) as target:
        streams = Streams(target)
        streams.send(3, tokens=100)                   # holds the one slot for about 1 s
        for p in (3, 2, 3, 1, 0, 2):                  # queued behind it, in this order
            streams.send(p)
        report = _report(target.url)
        streams.join()
    assert report["running"]["3"] == 1 and sum(report["waiting"].values()) == 6, report
    lines = sorted(read_send_log(log), key=lambda line: line["admitted_ns"])
    served = [(line["priority"], line["index"]) for line in lines]
    # The holder first, then P0, P1, the two P2 and the two P3 each in the order they came.
    assert served == [(3, 1), (0, 6), (1, 5), (2, 3), (2, 7), (3, 2), (3, 4)], served
    assert all(line["preempted"] == 0 and line["complete"] for line in lines)


@pytest.mark.timeout(60)
def test_without_a_scheduler_the_queue_is_first_come_first_served(tmp_path: Path) -> None:
    """The old way, kept: ``priority`` is ignored and the send log says so (``null``)."""
    log = tmp_path / "sends.jsonl"
    cfg = _config(log).model_copy(update={"scheduler": None})
    with start_target(cfg) as target:
        threads = []
        for i, p in enumerate((3, 3, 0, 1)):
            threads.append(t := threading.Thread(
                target=_post, args=(target.url, _body(p, 60 if i == 0 else 4)), daemon=True))
            t.start()
            time.sleep(0.05)            # a stream of 60 tokens takes 630 ms: they all queue
        for t in threads:
            t.join(timeout=30)
    lines = sorted(read_send_log(log), key=lambda line: line["admitted_ns"])
    assert [line["index"] for line in lines] == [1, 2, 3, 4]
    assert {line["priority"] for line in lines} == {None}


@pytest.mark.timeout(60)
def test_a_priority_limit_holds_and_a_p0_evicts_a_forming_stream(tmp_path: Path) -> None:
    log = tmp_path / "sends.jsonl"
    cfg = _config(log, capacity=2, per_priority={3: 1}, preempt=True)
    cfg = cfg.model_copy(update={"ttft": TargetConfig.model_validate({"ttft": "1s"}).ttft})
    with start_target(cfg) as target:
        streams = Streams(target)
        streams.send(3)
        streams.send(3)                  # a slot is free, but P3 may hold only one
        limited = _report(target.url)
        streams.send(2)                  # takes the free slot: the batch is full
        streams.send(0)                  # evicts the forming P3 and takes its slot
        evicted = _report(target.url)
        streams.join()
        final = _report(target.url)
    assert limited["running"] == {"0": 0, "1": 0, "2": 0, "3": 1}, limited
    assert limited["waiting"]["3"] == 1, limited
    assert evicted["running"] == {"0": 1, "1": 0, "2": 1, "3": 0}, evicted
    assert evicted["waiting"]["3"] == 2, evicted
    by_index = {line["index"]: line for line in read_send_log(log)}
    assert by_index[1]["preempted"] == 1 and by_index[1]["complete"], by_index[1]
    assert all(by_index[i]["preempted"] == 0 for i in (2, 3, 4))
    # The evicted P3 sent its first token after the P0's, and before the P3 behind it.
    first = {i: line["sent_ns"][next(k for k, c in enumerate(line["content"]) if c)]
             for i, line in by_index.items()}
    assert first[4] < first[1] < first[2], first
    assert final["priorities"]["3"]["preempted"] == 1, final
    assert final["priorities"]["3"]["admitted"] == 2, final      # the evicted one counts once
    assert final["priorities"]["3"]["waits"] == 3, final         # and waited twice
    assert final["priorities"]["0"]["wait_ms_max"] < final["priorities"]["3"]["wait_ms_max"]


@pytest.mark.timeout(30)
def test_a_bad_priority_in_a_request_is_answered_400_naming_it(tmp_path: Path) -> None:
    with start_target(_config(tmp_path / "sends.jsonl")) as target:
        for bad in (4, -1, "high", True, 1.5):
            status, body = _post(target.url, {**_body(None), "priority": bad})
            assert status == 400, (bad, body)
            assert b"'priority' must be an integer from 0 (served first) to 3" in body, body
        assert _post(target.url, _body(None))[0] == 200          # absent: 0, as vLLM reads it


BAD_BASE = """\
name: bad-priority
target:
  protocol: openai
  embedded:
    capacity: 4
    scheduler: SCHEDULER
load:
  classes:
    - name: p0
      priority: PRIORITY
      BODY
phases: {baseline: 2s, fault: 2s, recovery: 2s}
"""


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("scheduler", "priority", "body", "where", "says"), [
    ("{per_priority: {5: 2}}", "0", "", "6:32: target.embedded.scheduler.per_priority.5:",
     "less than or equal to 3"),
    ("{per_priority: {3: 0}}", "0", "", "6:5: target.embedded.scheduler:",
     "per_priority: 3: 0 would never admit a P3 stream"),
    ("{per_priority: {3: 9}}", "0", "", "4:3: target.embedded:",
     "scheduler.per_priority: 3: 9 is more than capacity (4)"),
    ("{policy: fifo}", "0", "", "6:17: target.embedded.scheduler.policy:", "'priority'"),
    ("{preempt: sometimes}", "0", "", "6:17: target.embedded.scheduler.preempt:", "boolean"),
    ("{}", "4", "", "10:7: load.classes.0.priority:", "less than or equal to 3"),
    ("{}", "high", "", "10:7: load.classes.0.priority:", "integer"),
    ("{}", "1", "body: {priority: 2, messages: []}", "9:7: load.classes.0:",
     "give it once, in 'priority' or in 'body'"),
])
def test_bad_priority_settings_are_located(tmp_path: Path, scheduler: str, priority: str,
                                           body: str, where: str, says: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_BASE.replace("SCHEDULER", scheduler).replace("PRIORITY", priority)
                    .replace("BODY", body))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    problems = [p.removeprefix(f"{path}:") for p in info.value.problems]
    assert any(p.startswith(where) and says in p for p in problems), problems


# A P3 flood past capacity: 4 streams at once, each about 230 ms (10 tokens 20 ms apart), so
# some 17 a second; the flood sends 40 a second, three in four of them P3. P0 asks 4 tokens.
FLOOD = """\
name: priority-flood-test
target:
  protocol: openai
  model: sim-1
  embedded:
    ttft: 30ms
    itl: 20ms
    output_tokens: {min: 10, max: 10}
    capacity: 4
    scheduler: {policy: priority, per_priority: {3: 3}, preempt: true}
    send_log: SEND_LOG
    seed: 9
  timeout: 20s
  probe: false
load:
  users: 2
  arrival: {rate: 6/s, process: poisson, max_inflight: 1000}
  classes:
    - {name: p0, weight: 1, priority: 0, prompt: "Complete: def f(", max_tokens: 4}
    - {name: p3, weight: 3, priority: 3, prompt: "Translate the notes.", max_tokens: 10}
  seed: 9
steps:
  - {name: warm, kind: warmup, duration: 1s}
  - {name: before, kind: baseline, duration: 2s}
  - {name: flood, kind: fault, duration: 3s, load: {rate: 40}}
  - {name: after, kind: recovery, duration: 2s}
slos:
  - {metric: error_rate, max: 0%}
"""


def _flood_run(tmp_path: Path, name: str, *extra: str) -> tuple[dict[str, Any],
                                                                  list[dict[str, Any]]]:
    log = tmp_path / f"{name}.jsonl"
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(FLOOD.replace("SEND_LOG", json.dumps(str(log))))
    out = tmp_path / name
    proc = run_cli("run", str(scenario), "--out", str(out), *extra, timeout=120)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    with open(out / "samples.csv", encoding="utf-8") as f:
        assert {row["class"] for row in csv.DictReader(f)} == {"p0", "p3"}
    return report, read_send_log(log)


def _ttft(report: dict[str, Any], step: str, cls: str) -> dict[str, float]:
    phase = next(p for p in report["phases"] if p["name"] == step)
    stats: dict[str, float] = phase["classes"][cls]["ttft_ms"]
    return stats


def _waits_ms(sends: list[dict[str, Any]], priority: int | None, of: set[int]) -> list[float]:
    return [(s["admitted_ns"] - s["arrived_ns"]) / 1e6 for s in sends
            if s["priority"] == priority and s["index"] in of]


@pytest.mark.slow            # two real runs of about 18 s
@pytest.mark.timeout(150)
def test_under_a_p3_flood_p0_keeps_its_ttft_with_the_scheduler_and_p3_waits(
        tmp_path: Path) -> None:
    with_report, with_sends = _flood_run(tmp_path, "with")
    fifo_report, fifo_sends = _flood_run(tmp_path, "without",
                                         "--set", "target.embedded.scheduler=null")
    p0_with, p0_fifo = _ttft(with_report, "flood", "p0"), _ttft(fifo_report, "flood", "p0")
    p3_with = _ttft(with_report, "flood", "p3")
    assert p0_with["count"] >= 10 and p0_fifo["count"] >= 10, (p0_with, p0_fifo)
    # The flood builds a queue: in one FIFO queue P0 waits in it, by priority it does not.
    assert p0_with["mean"] * 3 < p0_fifo["mean"], (p0_with, p0_fifo)
    assert p0_with["p95"] * 3 < p0_fifo["p95"], (p0_with, p0_fifo)
    # It is P3 that waits instead: its TTFT is the queue's, P0's the engine's own.
    assert p0_with["mean"] * 3 < p3_with["mean"], (p0_with, p3_with)
    # The target's own account: by priority, P0's queue waits are a small part of P3's; the
    # FIFO target read no priority at all.
    everyone = {s["index"] for s in with_sends}
    p0_waits, p3_waits = _waits_ms(with_sends, 0, everyone), _waits_ms(with_sends, 3, everyone)
    assert p0_waits and p3_waits
    assert fmean(p0_waits) * 3 < fmean(p3_waits), (fmean(p0_waits), fmean(p3_waits))
    assert {s["priority"] for s in fifo_sends} == {None}
    assert {s["priority"] for s in with_sends} == {0, 3}
    assert all(s["complete"] for s in with_sends + fifo_sends)
