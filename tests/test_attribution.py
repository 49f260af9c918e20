"""Which phase each measurement counts in (run/scoring.py), on constructed request samples:
scoring is a pure function of the samples, the arrivals never sent and the phase windows."""

from __future__ import annotations

import math
import random

import pytest

from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.run.scoring import assign_phases
from streamquake.run.scoring import score_samples as score
from streamquake.run.timeline import PhaseWindow
from streamquake.run.verdicts import evaluate
from streamquake.scenario import parse_scenario

WINDOWS = [PhaseWindow("baseline", 100.0, 110.0), PhaseWindow("fault", 110.0, 120.0)]

CLOSED = """
name: attribution
target: {protocol: openai, embedded: {}}
load: {classes: [{name: chat}]}
phases: {baseline: 10s, fault: 10s, recovery: 0s}
"""

OPEN = """
name: not-sent
target: {protocol: openai, embedded: {}}
load:
  arrival: {rate: 5/s, max_inflight: 2}
  classes: [{name: chat, weight: 3}, {name: batch}]
phases: {baseline: 10s, fault: 10s, recovery: 0s}
slos:
  - {metric: not_sent_rate, max: 1%}
  - {metric: ttft_scheduled_ms, percentile: 95, max: 300ms}
  - {metric: queue_delay_ms, percentile: 50, max: 1s}
"""


def _stream(sent: float, ttft: float, gaps: list[float], cls: str = "chat",
            scheduled: float | None = None) -> RequestSample:
    return RequestSample(cls=cls, sent=sent, scheduled=scheduled, ttfb_ms=5.0, ttft_ms=ttft,
                         itl_ms=gaps, e2e_ms=ttft + sum(gaps) + 5.0,
                         content_events=len(gaps) + 1, output_tokens=len(gaps) + 1,
                         usage_tokens=len(gaps) + 1)


def _nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@pytest.mark.timeout(20)
def test_a_slow_request_across_the_edge_keeps_its_ttft_and_its_in_phase_gaps() -> None:
    rng = random.Random(3)
    fast = [_stream(100.0 + 8.0 * i / 200, rng.uniform(80.0, 120.0), [20.0] * 5)
            for i in range(200)]
    # First token at ~109.5 s, in baseline; tokens then every 300 ms: one gap ends in
    # baseline (109.8), one spans the edge (109.8 -> 110.1), three fall in fault.
    slow = [_stream(109.0 + i * 0.001, 500.0 + i, [300.0] * 5) for i in range(8)]
    # First token at 110.2 s, after baseline ended: its TTFT belongs to no phase.
    late = [_stream(109.8, 400.0, [20.0] * 3) for _ in range(2)]
    later = [_stream(110.5 + 7.0 * i / 100, 100.0, [20.0] * 5) for i in range(100)]
    samples = fast + slow + late + later

    scored = score(parse_scenario(CLOSED), WINDOWS, samples)
    base, fault = scored.stats["baseline"], scored.stats["fault"]

    # TTFT: every request whose first token came within baseline, the slow ones included.
    in_phase = [s.ttft_ms for s in fast + slow if s.ttft_ms is not None]
    assert base.count("ttft_ms") == 208 and base.unattributed["ttft_ms"] == 2
    assert base.percentile("ttft_ms", 99) == pytest.approx(_nearest_rank(in_phase, 99), abs=0.1)
    assert base.percentile("ttft_ms", 99) > 500.0
    # Dropping whole requests that ended after the phase (the old rule) hid that tail.
    whole, _ = assign_phases(samples, WINDOWS)
    assert Stats.from_samples(whole["baseline"]).percentile("ttft_ms", 99) < 125.0

    # Gaps: each in the phase it happened in; the one across the edge is counted, not scored.
    assert base.count("itl_ms") == 200 * 5 + 8 * 1
    assert base.max("itl_ms") == pytest.approx(300.0, abs=0.1)
    assert base.unattributed["itl_ms"] == 8
    assert fault.count("itl_ms") == 100 * 5 + 8 * 3 + 2 * 3
    assert fault.unattributed["itl_ms"] == 0
    total_gaps = sum(len(s.itl_ms) for s in samples)
    assert total_gaps == sum(st.count("itl_ms") + st.unattributed["itl_ms"]
                             for st in (base, fault))

    # The request's end (E2E, outcome): in baseline only for those that ended there.
    assert base.sent == 210 and base.requests == 200 and base.unattributed["e2e_ms"] == 10
    assert base.count("e2e_ms") == 200 and base.count("ttfb_ms") == 210
    assert fault.sent == fault.requests == 100
    # The class's stats follow the same rule, and the report's dict says all of it.
    chat = scored.class_stats["baseline"]["chat"]
    assert chat.count("ttft_ms") == 208 and chat.unattributed == base.unattributed
    stats = scored.phases[0].stats
    assert stats["unattributed"] == {"ttfb_ms": 0, "ttft_ms": 2, "itl_ms": 8, "e2e_ms": 10,
                                     "queue_delay_ms": 0}
    assert "straddled" not in stats and stats["sent"] == 210 and stats["requests"] == 200
    assert scored.warnings == []


@pytest.mark.timeout(20)
def test_a_phase_too_short_for_its_requests_is_warned_about() -> None:
    # Every request ends after the phase: the outcome of none of them is scored there.
    samples = [_stream(109.0 + i * 0.01, 100.0, [200.0] * 10) for i in range(20)]
    scored = score(parse_scenario(CLOSED), WINDOWS, samples)
    (warning,) = scored.warnings
    assert warning.startswith("phase baseline: more measurements spanned a phase edge")
    assert "e2e_ms 20 of 20" in warning


@pytest.mark.timeout(20)
def test_arrivals_never_sent_count_in_the_phase_they_were_due_and_can_break_an_slo() -> None:
    sent = [_stream(100.5 + i * 0.2, 100.0, [20.0] * 3, cls="chat" if i % 2 else "batch",
                    scheduled=100.0 + i * 0.2) for i in range(20)]
    unsent = [UnsentArrival(cls="chat", scheduled=104.0 + i * 0.1, given_up=120.0)
              for i in range(30)]
    unsent += [UnsentArrival(cls="batch", scheduled=111.0 + i * 0.1, given_up=120.0,
                             reason="stopped") for i in range(5)]
    unsent.append(UnsentArrival(cls="chat", scheduled=99.0, given_up=120.0))   # no phase
    sc = parse_scenario(OPEN)
    scored = score(sc, WINDOWS, sent, unsent)
    base, fault = scored.stats["baseline"], scored.stats["fault"]

    assert (base.sent, base.not_sent, fault.sent, fault.not_sent) == (20, 30, 0, 5)
    assert base.value("not_sent_rate") == pytest.approx(30 / 50)
    assert fault.value("not_sent_rate") == 1.0
    assert scored.class_stats["baseline"]["chat"].not_sent == 30
    assert scored.class_stats["fault"]["batch"].not_sent == 5
    # Latency from the schedule: the 500 ms wait for a slot, then the 100 ms TTFT.
    assert base.percentile("queue_delay_ms", 50) == pytest.approx(500.0, abs=0.5)
    assert base.percentile("ttft_scheduled_ms", 95) == pytest.approx(600.0, abs=0.5)
    assert base.percentile("ttft_ms", 95) == pytest.approx(100.0, abs=0.1)
    assert base.percentile("e2e_scheduled_ms", 50) == pytest.approx(500.0 + 165.0, abs=0.5)
    assert scored.phases[0].stats["not_sent"] == 30
    assert scored.phases[0].stats["not_sent_rate"] == pytest.approx(0.6)
    assert [w.split(":")[:2] for w in scored.warnings] == [
        ["phase baseline", " 30 of 50 arrivals due were never sent (60.0%)"],
        ["phase fault", " 5 of 5 arrivals due were never sent (100.0%)"]]
    assert "at most 2 in flight" in scored.warnings[0]

    checks = evaluate(sc, scored.stats, scored.class_stats)
    by = {(c.metric, c.phase): c for c in checks}
    assert not by["not_sent_rate", "baseline"].passed
    assert by["not_sent_rate", "baseline"].samples == 50
    assert not by["not_sent_rate", "fault"].passed
    assert not by["ttft_scheduled_ms", "baseline"].passed      # 600 ms against 300 ms
    assert by["queue_delay_ms", "baseline"].passed


@pytest.mark.timeout(20)
def test_closed_loop_sends_every_request_and_has_no_schedule() -> None:
    samples = [_stream(100.0 + i * 0.1, 100.0, [20.0] * 3) for i in range(50)]
    sc = parse_scenario(OPEN.replace("arrival: {rate: 5/s, max_inflight: 2}",
                                     "think_time: {min: 0s, max: 0s}"))
    scored = score(sc, WINDOWS, samples)
    base = scored.stats["baseline"]
    assert base.value("not_sent_rate") == 0.0 and base.not_sent == 0
    checks = {(c.metric, c.phase): c for c in evaluate(sc, scored.stats, scored.class_stats)}
    assert checks["not_sent_rate", "baseline"].passed
    delay = checks["queue_delay_ms", "baseline"]
    assert delay.observed is None and "closed loop" in delay.detail
    assert scored.warnings == []
