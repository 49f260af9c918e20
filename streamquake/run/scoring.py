"""The statistics of each phase and class, from the load processes' merged scorecard.

Which measurement counts in which phase is decided where it is measured, in each load process
(``loadgen/scorecard.py`` has the rule, and docs/measurement.md "Which step a measurement
counts in"):
a request belongs to the step in which it was due (open loop) or sent (closed loop), and every
measurement of it counts there, whenever it ended (``ended_after`` says how many ended after
the step); one its timeout cut off counts as censored. Here the (phase, class) cells become
each phase's totals, its classes, and the warnings.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from streamquake.loadgen.attribution import WindowLike, due_at, ended_at, window_at
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.loadgen.scorecard import Scorecard
from streamquake.result import FaultRecord, PhaseResult
from streamquake.scenario import Scenario


def assign_phases(
    samples: list[RequestSample], windows: Sequence[WindowLike]
) -> tuple[dict[str, list[RequestSample]], dict[str, int]]:
    """Whole requests per phase: due (open loop) or sent (closed loop) in it, however late
    they ended (the rule, loadgen/scorecard.py). Returns (those requests, how many of them
    ended after the phase) per phase."""
    scored: dict[str, list[RequestSample]] = {w.name: [] for w in windows}
    ended_after = {w.name: 0 for w in windows}
    for s in samples:
        w = window_at(due_at(s), windows)
        if w is None:
            continue
        scored[w.name].append(s)
        if ended_at(s) > w.end:
            ended_after[w.name] += 1
    return scored, ended_after


@dataclass
class Scored:
    phases: list[PhaseResult] = field(default_factory=list)
    stats: dict[str, Stats] = field(default_factory=dict)
    class_stats: dict[str, dict[str, Stats]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def score(scenario: Scenario, windows: Sequence[WindowLike], card: Scorecard,
          dropped: ProxyDrops | None = None) -> Scored:
    """Each phase's totals (every class's cell merged), its classes, and the warnings.
    ``dropped``: when the streams went through the SSE proxy, what it dropped and when
    (:func:`proxy_drops`), to say where the tokens a usage counted but no event brought went."""
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
            out.warnings += _ended_after_warning(w.name, step.kind if step else w.name, stats)
            out.warnings += _shared_stamp_warning(scenario, w.name, stats)
            out.warnings += _bunched_warning(w.name, stats)
            out.warnings += _usage_warning(w.name, stats, *_dropped_during(
                dropped, w, stats, scenario.target.timeout_s))
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


ENDED_AFTER_WARN_SHARE = 0.25


def _ended_after_warning(phase: str, kind: str, stats: Stats) -> list[str]:
    """A step that is not a fault's, many of whose requests ended after it: they count here
    (every request is judged in the step it was due in), so its figures carry what the next
    step did to them. A fault step's requests outlasting it are the fault's own tail."""
    late = stats.ended_after.get("e2e_ms", 0)
    if kind == "fault" or not stats.requests or late <= ENDED_AFTER_WARN_SHARE * stats.requests:
        return []
    return [f"phase {phase}: {late:,} of its {stats.requests:,} requests ended after it; each "
            "counts in the step it was due in, so this step's figures also hold what came "
            "after it; make the step longer than a few request durations"]


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
    held = (f"; response headers held back with the whole answer in {stats.bunched_held:,}"
            if stats.bunched_held else "")
    return [f"phase {phase}: {stats.bunched:,} of {stats.bunch_judged:,} streams arrived in "
            f"bursts (content in {stats.bunched_reads:,} reads for {stats.bunched_events:,} "
            f"events; first token with the end in {stats.bunched_first_with_end:,}{held}): an "
            "intermediary (a proxy with buffering on, gzip, a CDN, a gateway that waits for the "
            "whole answer) is holding the stream back, or the server writes its events in "
            "batches; users see the text in lumps, and TTFT and ITL time the lumps. Behind "
            "nginx: proxy_buffering off (or the upstream's X-Accel-Buffering: no), and no gzip "
            "on text/event-stream"]


def _dropped_during(dropped: ProxyDrops | None, w: WindowLike, stats: Stats,
                    timeout_s: float) -> tuple[int | None, int]:
    """What the proxy dropped while the phase lasted, and (when some of its requests ran on
    past its end) what it dropped in the request timeout after: (None, 0) without a proxy."""
    if dropped is None:
        return None, 0
    late = stats.ended_after.get("e2e_ms", 0)
    return (dropped.within(w.start, w.end),
            dropped.within(w.end, w.end + timeout_s) if late else 0)


def _usage_warning(phase: str, stats: Stats, dropped: int | None = None,
                   dropped_after: int = 0) -> list[str]:
    """Streams whose usage counted more output tokens than content events arrived. Either
    the server never sent them as events (a token it counts but does not stream, such as a
    reasoning model's closing tag, or several tokens in one event) or they were lost on the
    way: the SSE proxy's own count of what it dropped (``dropped`` while the phase lasted,
    ``dropped_after`` while requests of it ran on past its end) tells the two apart where the
    streams went through it; elsewhere both are said."""
    if not stats.usage_short:
        return []
    unseen = stats.usage_unseen
    said = (f"phase {phase}: {stats.usage_short:,} of {stats.successes:,} successful streams "
            "brought fewer content events than their usage's output tokens "
            f"({unseen:,} of {stats.usage_tokens:,} tokens, "
            f"{stats.value('usage_deficit') or 0:.1%}, never arrived as events; usage_deficit): ")
    never = ("the server never sent them as events: it counts tokens it does not stream one "
             "by one (a reasoning model's closing tag, an end token) or puts several in one "
             "event")
    if dropped is None:
        why = ("either the server never sent them as events (it counts tokens it does not "
               "stream one by one, or puts several in one event) or they were lost on the way "
               "(a gateway, a proxy); nothing here counts what an intermediary dropped, so "
               "which one cannot be told")
    elif dropped == 0:
        why = ("the SSE proxy in front of the server dropped no event while this step "
               f"lasted (its own count), so {never}")
    elif dropped < unseen:
        why = (f"the SSE proxy's faults dropped {dropped:,} events while this step lasted "
               f"(its own count), so {unseen - dropped:,} or more were never sent: {never}")
    else:
        why = (f"the SSE proxy's faults dropped {dropped:,} events while this step lasted "
               "(its own count): enough to account for them, lost on the way (the server may "
               "also have left some unsent, which this cannot tell apart)")
    if dropped_after:
        late = stats.ended_after.get("e2e_ms", 0)
        why += (f"; {late:,} of its requests ran on past its end, while the proxy's faults "
                f"dropped {dropped_after:,} events, and may have lost some there")
    return [said + why]


@dataclass(frozen=True)
class ProxyDrops:
    """What the run's SSE proxy dropped, and when: ``spans`` (on, off, events dropped), one
    per fault record that counted drops; ``unplaced``, the drops its records cannot place
    (a flapping fault's earlier edges), which count wherever the proxy was."""

    spans: tuple[tuple[float, float, int], ...]
    unplaced: int

    def within(self, start: float, end: float) -> int:
        """Events dropped by faults that were on at some moment in (start, end): all that
        can have been dropped from requests while they ran then (at most)."""
        return self.unplaced + sum(n for on, off, n in self.spans if on < end and off > start)


def proxy_drops(telemetry: Mapping[str, object], records: Sequence[FaultRecord],
                windows: Sequence[WindowLike]) -> ProxyDrops | None:
    """The SSE proxy's own count of the events it dropped (``telemetry.sse_proxy.totals``),
    placed in time by the faults' records (``reverted.stats.events_dropped``, on from when
    applied to when reverted or its step ended, whichever came first: the runner reverts at
    the step's end). None when the streams did not go through the proxy, or its counters did
    not come back."""
    proxy = telemetry.get("sse_proxy")
    totals = proxy.get("totals") if isinstance(proxy, dict) else None
    total = totals.get("events_dropped") if isinstance(totals, dict) else None
    if not isinstance(total, int):
        return None
    ends = {w.name: w.end for w in windows}
    spans = []
    for r in records:
        stats = r.reverted.get("stats") if isinstance(r.reverted, dict) else None
        n = stats.get("events_dropped") if isinstance(stats, dict) else None
        if isinstance(n, int) and n > 0 and r.applied_at is not None:
            off = min(r.reverted_at or math.inf, ends.get(r.phase, math.inf))
            spans.append((r.applied_at, off, n))
    return ProxyDrops(tuple(spans), max(0, total - sum(n for _, _, n in spans)))


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
