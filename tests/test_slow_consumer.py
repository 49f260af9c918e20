"""A slow consumer: a request class that reads its streams at a byte rate, or with pauses, on
connections with a small receive buffer. Against the embedded target: the client directly, and
a whole ``streamquake run`` with a normal and a slow class side by side."""

from __future__ import annotations

import csv
import json
import random
import statistics
from pathlib import Path

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import start_target
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan, SlowRead
from streamquake.loadgen.samples import RequestSample
from tests.conftest import run_cli
from tests.helpers import assert_run_ok

RATE = 4000.0           # bytes/s: a 40-token OpenAI stream (about 10 kB) takes 2-3 s
PAUSE_S, EVERY = 0.2, 8

SCENARIO = """
name: slow-consumer
target:
  protocol: openai
  embedded:
    ttft: 20ms
    itl: 2ms
    output_tokens: {min: 40, max: 40}
    seed: 3
  timeout: 30s
load:
  users: 4
  think_time: {min: 10ms, max: 20ms}
  seed: 3
  classes:
    - {name: normal, max_tokens: 40}
    - {name: slow, max_tokens: 40, read: {rate: 4kB/s, receive_buffer: 4KiB}}
phases: {baseline: 8s, fault: 0s, recovery: 0s}
slos:
  - {metric: connect_ms, percentile: 95, max: 60000}
"""


def _mean_gap(s: RequestSample) -> float:
    return statistics.fmean(s.itl_ms)


@pytest.mark.timeout(60)
def test_a_paused_reader_pauses_after_every_n_events() -> None:
    config = TargetConfig.model_validate(
        {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 40, "max": 40}})
    read = SlowRead(pause_s=PAUSE_S, pause_every=EVERY, receive_buffer=4096)
    with start_target(config) as target:
        client = StreamClient(LoadPlan(base_url=target.url, protocol="openai",
                                       samples_path="/nonexistent", end_at=0.0, timeout_s=30.0))
        try:
            normal, paused = (client.measure(RequestClassPlan(max_tokens=40, read=r),
                                             random.Random(0)) for r in (None, read))
        finally:
            client.close()
    for s in (normal, paused):
        assert s.error is None and s.content_events == 40, s
    # A sleep is never shorter than asked: PAUSE_S for each EVERY events read. Its reads bring
    # an event or two, so 4 of the 5 pauses (40 content events) fall between its first and
    # last content events; 3 leaves room for where the reads split the stream.
    assert sum(paused.itl_ms) >= 3 * PAUSE_S * 1000.0, paused.itl_ms
    assert sum(normal.itl_ms) < sum(paused.itl_ms), normal.itl_ms
    # Its own gaps are what it saw: counted as the client's stalls, never the server's.
    assert paused.stalls == 0 and paused.clock == "user"
    assert not paused.reused      # its own connection (its receive buffer), not the normal one's


@pytest.mark.timeout(150)
def test_a_slow_class_reads_at_its_rate_and_the_report_shows_each_class(
        tmp_path: Path) -> None:
    scenario = tmp_path / "slow.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=120)
    assert_run_ok(proc, out)
    samples = [RequestSample.from_dict(json.loads(line))
               for f in sorted((out / "run" / "samples").glob("samples-*.jsonl"))
               for line in f.read_text().splitlines()]
    done = {c: [s for s in samples if s.cls == c and s.error is None] for c in ("normal", "slow")}
    assert len(done["slow"]) >= 2 and len(done["normal"]) >= 5, {
        c: len(v) for c, v in done.items()}
    for s in done["slow"]:
        assert s.ttfb_ms is not None and s.e2e_ms is not None
        # Body bytes over the time it read them, in the run: about the rate (pacing sleeps are
        # never shorter than asked; only the first block can come ahead of the pace).
        rate = s.body_bytes / ((s.e2e_ms - s.ttfb_ms) / 1000.0)
        assert 0.5 * RATE <= rate <= 1.15 * RATE, (rate, s)
    for s in done["normal"]:   # the same stream, read as it comes
        assert s.body_bytes / (s.e2e_ms or 1.0) * 1000.0 > 2 * RATE, s
    # What each class saw of the same streams, in the same run: the slow one's gaps are wider.
    assert min(map(_mean_gap, done["slow"])) > max(map(_mean_gap, done["normal"]))
    # Every sample's trace id is in samples.csv, next to its class.
    with open(out / "samples.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["class"], r["trace_id"]) for r in rows} == {(s.cls, s.trace_id) for s in samples}
    # The report: per class, both classes with how each read; the connect time as an SLO.
    report = json.loads((out / "report.json").read_text())
    (base,) = [p for p in report["phases"] if p["name"] == "baseline"]
    assert set(base["classes"]) == {"normal", "slow"}
    assert base["classes"]["slow"]["itl_ms"]["p50"] > base["classes"]["normal"]["itl_ms"]["p50"]
    (check,) = [c for c in report["checks"] if c["metric"] == "connect_ms"]
    assert check["observed"] is not None and check["passed"]
    html = (out / "report.html").read_text()
    assert "<td>slow</td><td class=\"l\">reads at most 4 kB/s, receive buffer 4096 B</td>" in html
    assert "<td>normal</td><td class=\"l\">as the stream comes</td>" in html
    summary = (out / "summary.md").read_text()
    assert "| slow (reads at most 4 kB/s, receive buffer 4096 B) |" in summary
    assert "| normal |" in summary
    # send_ms in parts, where measured: new connections here, plain HTTP to an IP address.
    assert "| send: connect p95 ms |" in summary and "| send: write p95 ms |" in summary
    assert "| send: TLS handshake p95 ms |" not in summary and "send: DNS" not in summary
