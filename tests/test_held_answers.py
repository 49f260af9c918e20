"""A held answer is caught whatever its reads look like (issue 31): a gateway that holds the
response until the server has finished, then writes each event on its own 0.5 ms apart
(LiteLLM's proxy did; tests/hold_relay.py does the same), and Debian's HAProxy with its
default configuration, are flagged; HAProxy with ``option http-no-delay`` passes the stream
on as it comes. llama-server direct and behind streaming nginx: tests/test_engine_parts.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake.loadgen.samples import RequestSample
from streamquake.reports.csv_report import iter_samples
from tests import hold_relay
from tests.conftest import listening, run_cli
from tests.gateways import haproxy
from tests.helpers import assert_run_ok

pytestmark = pytest.mark.timeout(150)

TOKENS = 30
# A server that takes 80 ms to its first token and 10 ms a token after (380 ms in all).
PACED = {"ttft": "80ms", "itl": "10ms", "output_tokens": {"min": TOKENS, "max": TOKENS},
         "seed": 3}

SCENARIO = """
name: {name}
target: {{protocol: openai, url: "{url}", timeout: 20s}}
load:
  users: 4
  think_time: {{min: 20ms, max: 60ms}}
  seed: 3
phases: {{warmup: 3s, baseline: 5s, fault: 0s, recovery: 0s}}
slos:
  - {{metric: error_rate, max: 100%}}
"""


@pytest.fixture(scope="module")
def paced_target() -> Iterator[str]:
    yield from listening([sys.executable, "-m", "streamquake.embedded", "--config-json",
                          json.dumps(PACED)], "embedded target")


class Run:
    def __init__(self, out: Path, stdout: str) -> None:
        self.stdout = stdout
        self.report = json.loads((out / "report.json").read_text())
        phase = next(p for p in self.report["phases"] if p["name"] == "baseline")
        self.stats: dict[str, Any] = phase["stats"]
        self.samples = [s for s in iter_samples(out / "run" / "samples")
                        if phase["start"] <= s.sent < phase["end"]]
        self.warnings = [w for w in self.report["errors"] if "arrived in bursts" in w]

    def line(self, name: str) -> str:
        s, b = self.stats, self.stats["bunching"]
        return (f"{name}: {b['bunched']} of {b['streams']} bunched ({b['held']} held), TTFB p50 "
                f"{s['ttfb_ms']['p50']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.1f} ms, ITL p50 "
                f"{s['itl_ms']['p50']:.2f} ms, E2E p50 {s['e2e_ms']['p50']:.1f} ms, gaps "
                f"sharing a stamp {s['shared_stamp_share']:.0%}")


def _run(tmp_path: Path, name: str, url: str) -> Run:
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(SCENARIO.format(name=name, url=url))
    out = tmp_path / name
    proc = run_cli("run", str(scenario), "--out", str(out), timeout=120)
    assert_run_ok(proc, out)
    run = Run(out, proc.stdout)
    assert len(run.samples) >= 8, run.stdout
    assert run.stats["errors"] == dict.fromkeys(run.stats["errors"], 0), run.stdout
    print("\n" + run.line(name))
    return run


def _span_ms(s: RequestSample) -> float:
    return sum(s.itl_ms)


@pytest.mark.timeout(10)
def test_held_is_judged_against_the_streams_own_length() -> None:
    def sample(ttfb: float, gaps: list[float], ttft: float | None = None) -> RequestSample:
        return RequestSample(cls="c", sent=0.0, ttfb_ms=ttfb, ttft_ms=ttft or ttfb, itl_ms=gaps,
                             content_events=len(gaps) + 1,
                             content_reads=len(gaps) + 1 if any(gaps) else 1)

    # LiteLLM in front of llama-server (issue 31): 48 tokens the engine took 203 ms to make
    # came 30 ms after headers it held until the end; each event in a read of its own.
    litellm = sample(233.0, [30.0 / 47] * 47)
    # llama-server direct: its headers come with the first token, the rest at its pace.
    engine = sample(10.0, [6.5] * 31)
    # A fast server that sends its headers at once and its tokens 0.2 ms apart.
    fast = sample(0.7, [0.2] * 29)
    # An engine that sends its headers with its first token after a long prompt (400 ms),
    # then makes 400 tokens/s: its answer comes within a quarter of that wait, but at an
    # engine's pace, not at a gateway's write after write.
    slowed = sample(400.0, [2.5] * 29)
    assert (litellm.held, litellm.bunched) == (True, True)
    # The fast server's headers at once, its 30 tokens 80 ms later in one read, 0.2 ms apart:
    # a load process that waited for a core read them together, after the last was in (one
    # stamp, gaps of 0). The headers came long before the answer: they were not held back.
    read_late = sample(4.0, [0.0] * 29, ttft=92.0)
    assert [s.held for s in (engine, fast, slowed, read_late)] == [False] * 4
    assert not any(s.bunched for s in (engine, fast, slowed, read_late))
    # Headers held back with that answer: they come with it, in the same read.
    assert sample(92.0, [0.0] * 29).held is True
    assert sample(233.0, [0.5] * 6).held is None        # too few events to say


def test_a_gateway_that_holds_the_whole_answer_is_flagged(tmp_path: Path,
                                                          paced_target: str) -> None:
    with hold_relay.serve(paced_target) as url:
        run = _run(tmp_path, "hold-relay", url)
    bunching = run.stats["bunching"]
    # Each answer came after the server had made it all (the headers 380 ms in), then whole
    # within a few ms: held, every one of them, however few events shared a read.
    assert bunching["streams"] == len(run.samples) > 0, bunching
    assert bunching["held"] >= 0.75 * bunching["streams"], bunching
    assert bunching["bunched"] >= bunching["held"], bunching
    spans = sorted(_span_ms(s) for s in run.samples)
    ttfb = sorted(s.ttfb_ms or 0.0 for s in run.samples)
    assert spans[len(spans) // 2] <= 0.25 * ttfb[len(ttfb) // 2], (spans, ttfb)
    (warning,) = run.warnings
    assert f"response headers held back with the whole answer in {bunching['held']:,}" \
        in warning, warning


def test_haproxy_with_debians_defaults_bunches_the_stream_and_is_flagged(
        tmp_path: Path, paced_target: str) -> None:
    direct = _run(tmp_path, "direct", paced_target)
    with haproxy(paced_target, "default", tmp_path / "haproxy-default") as gw:
        run = _run(tmp_path, "haproxy-default", gw.url)
    bunching = run.stats["bunching"]
    assert bunching["streams"] == len(run.samples) > 0, bunching
    assert bunching["share"] >= 0.8, bunching
    # In lumps: several events a read, the first token held back with the headers.
    assert bunching["reads"] * 3 <= bunching["events"], bunching
    assert run.stats["ttft_ms"]["p50"] > 1.5 * direct.stats["ttft_ms"]["p50"], \
        (run.stats["ttft_ms"], direct.stats["ttft_ms"])
    assert run.warnings and not direct.warnings
    assert direct.stats["bunching"]["bunched"] == 0, direct.stats["bunching"]


def test_haproxy_with_http_no_delay_passes_the_stream_on(tmp_path: Path,
                                                          paced_target: str) -> None:
    with haproxy(paced_target, "no-delay", tmp_path / "haproxy-no-delay") as gw:
        run = _run(tmp_path, "haproxy-no-delay", gw.url)
    bunching = run.stats["bunching"]
    assert bunching["streams"] == len(run.samples) > 0 and bunching["bunched"] == 0, bunching
    assert not run.warnings, run.warnings
    # Headers at once, then each event as the server made it (10 ms apart).
    assert run.stats["ttfb_ms"]["p50"] < 0.25 * run.stats["ttft_ms"]["p50"], run.stats
    assert run.stats["shared_stamp_share"] <= 0.2, run.stats["shared_stamp_share"]
