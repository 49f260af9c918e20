"""The statistics of each phase and class, from the load processes' merged scorecard.

Which measurement counts in which phase is decided where it is measured, in each load process
(``loadgen/scorecard.py`` has the rule and the README "Which phase a measurement counts in"):
a request belongs to the phase in which it was due (open loop) or sent (closed loop); each
measurement counts there only if it ended within that phase; inter-token gaps count in the
phase they happened in. What no phase can own is counted in ``unattributed``, never dropped.
Here the (phase, class) cells become each phase's totals, its classes, and the warnings.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamquake.loadgen.metrics import UNATTRIBUTED, Stats
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.loadgen.scorecard import Scorecard, WindowLike, due_at, ended_at, window_at
from streamquake.result import PhaseResult
from streamquake.scenario import Scenario


def assign_phases(
    samples: list[RequestSample], windows: Sequence[WindowLike]
) -> tuple[dict[str, list[RequestSample]], dict[str, int]]:
    """Whole requests per phase, by the rule for a request's end (its outcome and E2E): due
    (open loop) or sent (closed loop) in the phase, and ended within it. Returns (those
    requests, how many due there ended after the phase) per phase. Used where a request is
    taken whole (samples.csv, ``compare``); the verdicts attribute each measurement instead
    (loadgen/scorecard.py)."""
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


@dataclass
class Scored:
    phases: list[PhaseResult] = field(default_factory=list)
    stats: dict[str, Stats] = field(default_factory=dict)
    class_stats: dict[str, dict[str, Stats]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def score(scenario: Scenario, windows: Sequence[WindowLike], card: Scorecard) -> Scored:
    """Each phase's totals (every class's cell merged), its classes, and the warnings."""
    out = Scored()
    for w in windows:
        total = out.stats[w.name] = Stats()
        classes = out.class_stats[w.name] = {rc.name: Stats() for rc in scenario.load.classes}
        for (phase, cls), cell in card.cells.items():
            if phase != w.name:
                continue
            total.merge(cell)
            if cls in classes:
                classes[cls] = cell       # the card's own cell: one class in one phase
    steps = {step.name: step for step in scenario.timeline}
    warm = {name for name, step in steps.items() if step.kind == "warmup"}
    for w in windows:
        stats = out.stats[w.name]
        step = steps.get(w.name)
        if w.name not in warm:
            out.warnings += _not_sent_warning(scenario, w.name, stats)
            out.warnings += _unattributed_warning(w.name, stats)
            out.warnings += _shared_stamp_warning(scenario, w.name, stats)
            out.warnings += _bunched_warning(w.name, stats)
            out.warnings += _usage_warning(w.name, stats)
        out.phases.append(PhaseResult(
            name=w.name, start=w.start, end=w.end, stats=stats.to_dict(),
            classes={k: v.to_dict() for k, v in out.class_stats[w.name].items()},
            kind=step.kind if step is not None else w.name,
            faults=list(step.faults) if step is not None else [],
            load=(step.load.model_dump(mode="json", by_alias=True, exclude_none=True)
                  if step is not None and step.load is not None else None),
        ))
    out.warnings += _late_start(windows, card.first_sent, warm)
    scored = [out.stats[w.name] for w in windows if w.name not in warm]
    out.warnings += _counted_tokens_warning(scored)
    out.warnings += _model_warning(scenario, scored)
    return out


def score_samples(scenario: Scenario, windows: Sequence[WindowLike],
                  samples: Sequence[RequestSample],
                  unsent: Sequence[UnsentArrival] = ()) -> Scored:
    """:func:`score` of one scorecard made from these records (what a load process does)."""
    return score(scenario, windows, Scorecard.of(windows, samples, unsent))


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


SHARED_MIN_GAPS = 100


def _shared_stamp_warning(scenario: Scenario, phase: str, stats: Stats) -> list[str]:
    """Events read together share one stamp: the gap between them reads 0 and the next one
    holds both. A share f of such gaps can move any percentile p with min(p, 100 - p) <= 100 f
    (the zeros fill the bottom, the doubled gaps the top); say which ones, when any."""
    share = stats.shared_stamp_share
    gaps = stats.count("itl_ms")
    if share is None or gaps < SHARED_MIN_GAPS or not stats.shared_stamps:
        return []
    slos = itertools.chain(scenario.slos, *(rc.slos for rc in scenario.load.classes))
    wanted = {50.0, 90.0, 95.0, 99.0} | {float(s.percentile) for s in slos
                                         if s.metric == "itl_ms" and s.percentile is not None}
    bent = sorted(p for p in wanted if min(p, 100.0 - p) <= 100.0 * share)
    if not bent:
        return []
    return [f"phase {phase}: {stats.shared_stamps:,} of {gaps:,} inter-token gaps ({share:.1%}) "
            "came in one read with the event before, so they share its stamp: each reads "
            "0 ms and the next gap holds both; that share can move itl_ms "
            f"{', '.join(f'p{p:g}' for p in bent)}. Either the server sent those events "
            "together or the load process read them late (see the client figures)"]


BUNCHED_WARN_SHARE = 0.1


def _bunched_warning(phase: str, stats: Stats) -> list[str]:
    """Streams that arrived in bursts (RequestSample.bunched): "works locally, arrives all at
    once in production", most often a gateway that buffers or compresses the stream."""
    share = stats.bunched_share
    if share is None or share < BUNCHED_WARN_SHARE:
        return []
    return [f"phase {phase}: {stats.bunched:,} of {stats.bunch_judged:,} streams arrived in "
            f"bursts (content in {stats.bunched_reads:,} reads for {stats.bunched_events:,} "
            f"events; first token with the end in {stats.bunched_first_with_end:,}): an "
            "intermediary (a proxy with buffering on, gzip, a CDN) is holding the stream back, "
            "or the server writes its events in batches; users see the text in lumps, and TTFT "
            "and ITL time the lumps. Behind nginx: proxy_buffering off (or the upstream's "
            "X-Accel-Buffering: no), and no gzip on text/event-stream"]


def _usage_warning(phase: str, stats: Stats) -> list[str]:
    """Streams whose usage counted more output tokens than content events arrived: chunks
    lost on the way (a proxy, a gateway), where the server numbers no events to count them."""
    if not stats.usage_short:
        return []
    return [f"phase {phase}: {stats.usage_short:,} of {stats.successes:,} successful streams "
            "brought fewer content events than their usage's output tokens "
            f"({stats.usage_unseen:,} of {stats.usage_tokens:,} tokens, "
            f"{stats.value('usage_deficit') or 0:.1%}, never arrived as events; usage_deficit): "
            "chunks were lost on the way, or the server puts several tokens in one event"]


def _counted_tokens_warning(phases: Sequence[Stats]) -> list[str]:
    counted = sum(s.tokens_counted for s in phases)
    if not counted:
        return []
    total = sum(s.successes for s in phases)
    return [f"{counted:,} of {total:,} successful requests came without the server's usage, so "
            "their output tokens (and tokens/s) count the content events that arrived: a "
            "fault that drops chunks lowers them, and a server that puts several tokens in "
            "one event is under-counted (OpenAI-compatible servers send usage when asked with "
            "stream_options.include_usage, which streamquake asks for)"]


def _model_warning(scenario: Scenario, phases: Sequence[Stats]) -> list[str]:
    """The answers named another model than the one asked for: many OpenAI-compatible servers
    answer any name with the one model they serve, so the figures may not be that model's."""
    asked = {scenario.target.model} | {
        m for rc in scenario.load.classes
        if isinstance(rc.body, dict) and isinstance(m := rc.body.get("model"), str)}
    named: dict[str, int] = {}
    for stats in phases:
        for name, n in stats.answered_models.items():
            named[name] = named.get(name, 0) + n
    # A dated or versioned name answers its family ("gpt-4o" -> "gpt-4o-2024-08-06").
    other = {name: n for name, n in named.items()
             if not any(name.startswith(a) or a.startswith(name) for a in asked)}
    if not other:
        return []
    seen = ", ".join(f"{name!r} ({n:,})" for name, n in
                     sorted(other.items(), key=lambda kv: -kv[1]))
    return [f"the answers named another model than the scenario asked for "
            f"({', '.join(map(repr, sorted(asked)))}): {seen}; the server may serve one model "
            "whatever the request names, so these figures are that model's"]


def _late_start(windows: Sequence[WindowLike], first_sent: float | None,
                warm: set[str]) -> list[str]:
    """The warm-up exists to absorb cold starts (new connections, first requests); if the load
    generator sent nothing before it ended, they were scored in the first measured phase."""
    if first_sent is None or not windows or windows[0].name not in warm:
        return []
    warmup = windows[0]
    if first_sent < warmup.end:
        return []
    return [f"the load generator sent its first request {first_sent - warmup.end:.1f} s after "
            "the warm-up ended, so cold-start requests (new connections) were scored in the "
            f"{windows[1].name if len(windows) > 1 else 'next'} phase; make warmup longer "
            "(this machine starts Locust slowly)"]
