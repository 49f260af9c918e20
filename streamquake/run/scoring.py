"""Which measurement counts in which phase, and the statistics of each phase and class.

A request belongs to the phase in which it was due (open loop) or sent (closed loop); each of
its measurements counts there only if it ended within that phase, since a measurement that
spans a phase edge saw two worlds (a fault applied or reverted while it ran). Inter-token gaps
count in the phase they happened in. Whatever no phase can own is counted per phase in
``unattributed``, never dropped unseen (README "Which phase a measurement counts in").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamquake.loadgen.metrics import UNATTRIBUTED, Stats
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.result import PhaseResult
from streamquake.run.timeline import PhaseWindow
from streamquake.scenario import Scenario

# Where one request's measurements go: the phase's stats and its class's stats in that phase.
Into = Callable[[str, str], list[Stats]]


def due_at(s: RequestSample) -> float:
    return s.scheduled if s.scheduled is not None else s.sent


def ended_at(s: RequestSample) -> float:
    return s.sent + (s.e2e_ms or 0.0) / 1000.0


def window_at(t: float, windows: Sequence[PhaseWindow]) -> PhaseWindow | None:
    return next((w for w in windows if w.start <= t < w.end), None)


def assign_phases(
    samples: list[RequestSample], windows: list[PhaseWindow]
) -> tuple[dict[str, list[RequestSample]], dict[str, int]]:
    """Whole requests per phase, by the rule for a request's end (its outcome and E2E): due
    (open loop) or sent (closed loop) in the phase, and ended within it. Returns (those
    requests, how many due there ended after the phase) per phase. Used where a request is
    taken whole (samples.csv, ``compare``); the verdicts attribute each measurement instead
    (:func:`score`)."""
    scored: dict[str, list[RequestSample]] = {w.name: [] for w in windows}
    ended_after = {w.name: 0 for w in windows}
    for s in samples:
        w = window_at(due_at(s), windows)
        if w is None:
            continue
        if ended_at(s) <= w.end:
            scored[w.name].append(s)
        else:
            ended_after[w.name] += 1
    return scored, ended_after


def attribute(s: RequestSample, windows: Sequence[PhaseWindow], into: Into) -> None:
    """Add each measurement of ``s`` to the phase it belongs to (see the module's rule)."""
    home = window_at(due_at(s), windows)
    if home is None:
        return
    here = into(home.name, s.cls)
    if s.retried:
        for st in here:
            st.add_retried(s)
        return

    def put(inside: bool, add: Callable[[Stats], None], metric: str) -> None:
        for st in here:
            if inside:
                add(st)
            else:
                st.add_unattributed(metric)

    for st in here:
        st.add_sent(s)
    if s.scheduled is not None:
        put(s.sent <= home.end, lambda st: st.add_queue_delay(s), "queue_delay_ms")
    if s.ttfb_ms is not None:
        put(s.sent + s.ttfb_ms / 1000.0 <= home.end, lambda st: st.add_first_byte(s),
            "ttfb_ms")
    first_token = None if s.ttft_ms is None else s.sent + s.ttft_ms / 1000.0
    if first_token is not None:
        put(first_token <= home.end, lambda st: st.add_first_token(s), "ttft_ms")
    # Each gap is placed in time: the first token, then the gaps one after another.
    t = first_token
    for gap in s.itl_ms:
        if t is None:
            put(False, lambda st: None, "itl_ms")
            continue
        end = t + gap / 1000.0
        w = window_at(t, windows)
        if w is not None and end <= w.end:
            for st in into(w.name, s.cls):
                st.add_gap(gap)
        else:
            put(False, lambda st: None, "itl_ms")
        t = end
    put(ended_at(s) <= home.end, lambda st: st.add_outcome(s), "e2e_ms")


@dataclass
class Scored:
    phases: list[PhaseResult] = field(default_factory=list)
    stats: dict[str, Stats] = field(default_factory=dict)
    class_stats: dict[str, dict[str, Stats]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def score(scenario: Scenario, windows: list[PhaseWindow], samples: list[RequestSample],
          unsent: Sequence[UnsentArrival] = ()) -> Scored:
    out = Scored()
    for w in windows:
        out.stats[w.name] = Stats()
        out.class_stats[w.name] = {rc.name: Stats() for rc in scenario.load.classes}

    def into(phase: str, cls: str) -> list[Stats]:
        by_class = out.class_stats[phase].get(cls)
        return [out.stats[phase]] + ([by_class] if by_class is not None else [])

    for s in samples:
        attribute(s, windows, into)
    for u in unsent:
        home = window_at(u.scheduled, windows)
        if home is not None:
            for st in into(home.name, u.cls):
                st.add_not_sent()
    for w in windows:
        stats = out.stats[w.name]
        if w.name != "warmup":
            out.warnings += _not_sent_warning(scenario, w.name, stats)
            out.warnings += _unattributed_warning(w.name, stats)
        out.phases.append(PhaseResult(
            name=w.name, start=w.start, end=w.end, stats=stats.to_dict(),
            classes={k: v.to_dict() for k, v in out.class_stats[w.name].items()},
        ))
    out.warnings += _late_start(windows, samples)
    return out


def _not_sent_warning(scenario: Scenario, phase: str, stats: Stats) -> list[str]:
    if not stats.not_sent:
        return []
    due = stats.sent + stats.not_sent
    arrival = scenario.load.arrival
    limit = f" (at most {arrival.max_inflight} in flight)" if arrival is not None else ""
    return [f"phase {phase}: {stats.not_sent} of {due} arrivals due were never sent "
            f"({stats.not_sent / due:.1%}): the client could not keep up with load.arrival"
            f"{limit}; those sent waited for a slot (queue_delay_ms, ttft_scheduled_ms), and "
            "an SLO on not_sent_rate can gate on it"]


def _unattributed_warning(phase: str, stats: Stats) -> list[str]:
    """When more measurements fell across the phase's end than within it, the phase is too
    short for its requests and its numbers stand on the few that fit."""
    heavy = []
    for metric in UNATTRIBUTED:
        left = stats.unattributed.get(metric, 0)
        kept = stats.requests if metric == "e2e_ms" else stats.count(metric)
        if left > kept:
            heavy.append(f"{metric} {left} of {left + kept}")
    if not heavy:
        return []
    return [f"phase {phase}: more measurements spanned a phase edge than fit in the phase, "
            f"so they were not attributed ({', '.join(heavy)}; e2e_ms stands for requests "
            "whose end, and so outcome, fell after the phase); make the phase longer than a "
            "few request durations"]


def _late_start(windows: list[PhaseWindow], samples: list[RequestSample]) -> list[str]:
    """The warm-up exists to absorb cold starts (new connections, first requests); if the load
    generator sent nothing before it ended, they were scored in the first measured phase."""
    if not samples or not windows or windows[0].name != "warmup":
        return []
    first = min(s.sent for s in samples)
    warmup = windows[0]
    if first < warmup.end:
        return []
    return [f"the load generator sent its first request {first - warmup.end:.1f} s after the "
            "warm-up ended, so cold-start requests (new connections) were scored in the "
            f"{windows[1].name if len(windows) > 1 else 'next'} phase; make warmup longer "
            "(this machine starts Locust slowly)"]
