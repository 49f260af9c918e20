"""Which phase each measurement counts in (run/scoring.py), on constructed request samples:
scoring is a pure function of the samples, the arrivals never sent and the phase windows."""

from __future__ import annotations

import math
import random

import pytest

from streamquake.loadgen.attribution import attribute
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample, UnsentArrival
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
def test_every_measurement_of_a_request_counts_in_the_step_it_was_due_whenever_it_ended() -> None:
    rng = random.Random(3)
    fast = [_stream(100.0 + 8.0 * i / 200, rng.uniform(80.0, 120.0), [20.0] * 5)
            for i in range(200)]
    # First token at ~109.5 s, in baseline; tokens then every 300 ms: one gap ends in
    # baseline (109.8), four after it.
    slow = [_stream(109.0 + i * 0.001, 500.0 + i, [300.0] * 5) for i in range(8)]
    # First token at 110.2 s, after baseline ended: still baseline's (it was sent there).
    late = [_stream(109.8, 400.0, [20.0] * 3) for _ in range(2)]
    later = [_stream(110.5 + 7.0 * i / 100, 100.0, [20.0] * 5) for i in range(100)]
    samples = fast + slow + late + later

    scored = score(parse_scenario(CLOSED), WINDOWS, samples)
    base, fault = scored.stats["baseline"], scored.stats["fault"]

    # TTFT: every request sent in baseline, the slowest (after the edge) included.
    mine = fast + slow + late
    assert base.count("ttft_ms") == 210 and base.ended_after["ttft_ms"] == 2
    assert base.percentile("ttft_ms", 99) == pytest.approx(
        _nearest_rank([s.ttft_ms for s in mine if s.ttft_ms is not None], 99), abs=0.1)
    # The rule this replaces (a measurement counts only if it ended within its step, kept
    # for windows inside a step: strict=True) left the two late first tokens out, and the
    # requests that ended after the step out of the error rate and E2E altogether.
    strict = {"baseline": Stats(), "fault": Stats()}
    for s in samples:
        attribute(s, WINDOWS, strict.__getitem__, strict=True)
    assert strict["baseline"].count("ttft_ms") == 208
    assert strict["baseline"].requests == 200 and strict["baseline"].unattributed["e2e_ms"] == 10

    # Gaps: every gap of a baseline request in baseline, wherever in time it fell.
    assert base.count("itl_ms") == 200 * 5 + 8 * 5 + 2 * 3
    assert base.ended_after["itl_ms"] == 8 * 4 + 2 * 3
    assert fault.count("itl_ms") == 100 * 5
    total_gaps = sum(len(s.itl_ms) for s in samples)
    assert total_gaps == base.count("itl_ms") + fault.count("itl_ms")

    # The request's end (E2E, outcome): in baseline, for every request sent there.
    assert base.sent == base.requests == 210 and base.ended_after["e2e_ms"] == 10
    assert base.count("e2e_ms") == 210 and base.count("ttfb_ms") == 210
    assert fault.sent == fault.requests == 100
    assert sum(base.unattributed.values()) == sum(fault.unattributed.values()) == 0
    # The class's stats follow the same rule, and the report's dict says all of it.
    chat = scored.class_stats["baseline"]["chat"]
    assert chat.count("ttft_ms") == 210 and chat.ended_after == base.ended_after
    stats = scored.phases[0].stats
    assert stats["ended_after"] == {"ttft_ms": 2, "itl_ms": 38, "e2e_ms": 10}
    assert stats["sent"] == 210 and stats["requests"] == 210
    assert scored.warnings == []


@pytest.mark.timeout(20)
def test_requests_that_outlast_their_step_are_its_errors_and_timeouts_are_censored() -> None:
    # The fault step's requests: 40 answer at once, 66 only after the step ended (a slow
    # link), 4 time out with no first token after 20 s. None of the slow ones ends within
    # the step: the rule this replaces judged the step by the 40 fast ones alone.
    fast = [_stream(110.0 + 0.1 * i, 300.0, [20.0] * 5) for i in range(40)]
    slow = [_stream(114.0 + 0.09 * i, 7000.0 + 10 * i, [50.0] * 5) for i in range(66)]
    timed_out = [RequestSample(cls="chat", sent=119.5 + 0.1 * i, e2e_ms=20000.0,
                               error="timeout", error_detail="no complete stream within 20 s")
                 for i in range(4)]
    samples = fast + slow + timed_out
    sc = parse_scenario(CLOSED + """
slos:
  - {metric: error_rate, max: 1%, phases: [fault]}
  - {metric: ttft_ms, percentile: 95, max: 10s, phases: [fault]}
  - {metric: ttft_ms, percentile: 50, max: 10s, phases: [fault]}
""")
    scored = score(sc, WINDOWS, samples)
    fault = scored.stats["fault"]
    assert fault.sent == fault.requests == 110 and fault.error_count == 4
    assert fault.value("error_rate") == pytest.approx(4 / 110)
    assert fault.count("ttft_ms") == 106 and fault.censored_count("ttft_ms") == 4
    assert fault.samples("ttft_ms") == 110
    # p95 (rank 105 of 110) lies among the measured values: exact, from the slow ones.
    p95, exact = fault.percentile_bound("ttft_ms", 95)
    assert exact and p95 == pytest.approx(7000.0 + 10 * 64, abs=1.0)
    # p99 (rank 109) lies among the censored ones: at least their 20 s, a lower bound.
    p99, exact = fault.percentile_bound("ttft_ms", 99)
    assert not exact and p99 == pytest.approx(20000.0, rel=1e-3)
    summary = scored.phases[1].stats["ttft_ms"]
    assert summary["count"] == 106 and summary["censored"] == 4
    assert summary["at_least"] == ["p99", "max"]

    by = {(c.metric, c.percentile, c.phase): c for c in evaluate(sc, scored.stats,
                                                                   scored.class_stats)}
    errors = by["error_rate", None, "fault"]
    assert not errors.passed and errors.samples == 110
    ttft95 = by["ttft_ms", 95, "fault"]
    assert ttft95.samples == 110 and ttft95.observed == pytest.approx(p95)
    # Its interval's upper rank falls among the censored: unbounded, so met by the value
    # alone (inconclusive; verdicts.inconclusive decides how that gates).
    assert ttft95.passed and ttft95.inconclusive and ttft95.ci_high is None
    assert by["ttft_ms", 50, "fault"].passed

    # Half the step timed out: its p95 is known only as at least 20 s, and that is enough
    # to break a 10 s limit for certain (a known violation, not an inconclusive one).
    stuck = [RequestSample(cls="chat", sent=110.0 + 0.1 * i, e2e_ms=20000.0, error="timeout")
             for i in range(50)]
    scored = score(sc, WINDOWS, fast + stuck)
    by = {(c.metric, c.percentile, c.phase): c for c in evaluate(sc, scored.stats,
                                                                   scored.class_stats)}
    worst = by["ttft_ms", 95, "fault"]
    assert not worst.passed and not worst.inconclusive
    assert worst.ci_low is not None and worst.ci_low > 10000.0 and worst.ci_high is None


@pytest.mark.timeout(20)
def test_a_step_too_short_for_its_requests_is_warned_about() -> None:
    # Every request ends after the step: all are counted there, and the run says so.
    samples = [_stream(109.0 + i * 0.01, 100.0, [200.0] * 10) for i in range(20)]
    scored = score(parse_scenario(CLOSED), WINDOWS, samples)
    (warning,) = scored.warnings
    assert warning.startswith("phase baseline: 20 of its 20 requests ended after it")
    assert scored.stats["baseline"].requests == 20


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
