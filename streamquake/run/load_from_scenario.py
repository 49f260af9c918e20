"""Turn a validated scenario into the load process's plan (the only bridge between the two)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from streamquake.loadgen.attribution import WindowLike
from streamquake.loadgen.plan import (
    Cancel,
    ClosedLoop,
    Conversation,
    LoadPlan,
    LoadStage,
    OpenLoop,
    RequestClassPlan,
    SlowRead,
    TraceReplay,
)
from streamquake.scenario import Scenario
from streamquake.scenario.schema import LoadSpec, RequestClass, TraceSpec
from streamquake.scenario.steps import Ramp, StepSpec


def load_plan_for(scenario: Scenario, base_url: str, samples_dir: Path, end_at: float,
                  windows: Sequence[WindowLike] = (), cards_dir: Path | None = None) -> LoadPlan:
    load, target = scenario.load, scenario.target
    arrival: ClosedLoop | OpenLoop | TraceReplay
    users = load.users
    if load.trace is not None:
        arrival = _trace(load.trace, end_at - scenario.total_s,
                         max(1, load.workers + load.remote_workers),
                         {c.name for c in load.classes})
        users = arrival.processes       # one dispatching user per load process
    elif load.arrival is not None:
        arrival = OpenLoop(
            rate_per_s=load.arrival.rate_per_s,
            process=load.arrival.process,
            max_inflight=load.arrival.max_inflight,
        )
    elif load.think_time is not None:
        arrival = ClosedLoop(
            think_time_min_s=load.think_time.min_s, think_time_max_s=load.think_time.max_s
        )
    else:
        arrival = ClosedLoop()
    stages = load_stages(scenario.timeline, windows, load)
    spawn_rate = load.spawn_rate or float(users)
    if stages and stages[0].users is not None:
        users = stages[0].users         # Locust starts with the first step's; it follows them
        spawn_rate = load.spawn_rate or float(max(s.users or 0 for s in stages))
    return LoadPlan(
        base_url=base_url,
        protocol=target.protocol,
        model=target.model,
        path=target.path,
        headers=dict(target.headers),
        verify_tls=target.verify_tls,
        timeout_s=target.timeout_s,
        connect_timeout_s=target.connect_timeout_s,
        stall_threshold_ms=load.stall_threshold_ms,
        users=users,
        spawn_rate=spawn_rate,
        arrival=arrival,
        classes=[_conversation(_class(c), c, load.seed) for c in load.classes],
        samples_path=str(samples_dir),
        windows=[(w.name, w.start, w.end) for w in windows],
        raw_samples=load.samples == "all",
        scorecards_path="" if cards_dir is None else str(cards_dir),
        seed=load.seed,
        end_at=end_at,
        retries=load.retries,
        max_line_bytes=load.limits.line_bytes,
        max_event_bytes=load.limits.event_bytes,
        max_data_lines=load.limits.data_lines,
        stages=stages,
    )


def load_stages(steps: Sequence[StepSpec], windows: Sequence[WindowLike],
                load: LoadSpec) -> list[LoadStage]:
    """One stage a step, over its window: the step's own load, or the scenario's where it
    gives none. None at all where no step has a load of its own (the load is constant), or
    without windows (a probe)."""
    if not windows or all(step.load is None for step in steps):
        return []
    by_name = {w.name: w for w in windows}
    stages = []
    for step in steps:
        w = by_name[step.name]
        own = step.load
        if load.arrival is None:        # a closed loop (validation: no step has a rate)
            users = own.users if own is not None and own.users is not None else load.users
            stages.append(LoadStage(start=w.start, end=w.end, users=users))
            continue
        rate = load.arrival.rate_per_s if own is None or own.rate is None else own.rate
        ramp = (rate.start, rate.end) if isinstance(rate, Ramp) else (rate, rate)
        spike = None if own is None or own.spike is None else (
            w.start + own.spike.at_s, w.start + own.spike.at_s + own.spike.for_s,
            own.spike.rate)
        stages.append(LoadStage(start=w.start, end=w.end, rate_from=ramp[0], rate_to=ramp[1],
                                spike=spike))
    return stages


def _conversation(plan: RequestClassPlan, c: RequestClass, seed: int) -> RequestClassPlan:
    """The class's ``conversation``, its system prefix as text: a count of tokens becomes a
    seeded text of that many words, the same in every session and every load process."""
    spec = c.conversation
    if spec is None:
        return plan
    from streamquake.loadgen.trace import synth_prompt

    system = spec.system_prefix if isinstance(spec.system_prefix, str) else \
        synth_prompt(spec.system_prefix, random.Random(f"{seed}/system/{c.name}"))
    return plan.model_copy(update={"conversation": Conversation(
        turns=spec.turns, system=system, think_min_s=spec.think_time.min_s,
        think_max_s=spec.think_time.max_s)})


def _class(c: RequestClass) -> RequestClassPlan:
    read = None if c.read is None else SlowRead(
        rate_bytes_per_s=c.read.rate_bytes_per_s, pause_s=c.read.pause_s,
        pause_every=c.read.every, receive_buffer=c.read.receive_buffer)
    cancel = None if c.cancel is None else Cancel(
        share=c.cancel.share, after_tokens=c.cancel.after_tokens,
        after_s=None if c.cancel.after_ms is None else c.cancel.after_ms / 1000.0)
    if c.dataset is None:
        return RequestClassPlan(name=c.name, weight=c.weight, prompts=c.prompt_list,
                                max_tokens=c.max_tokens, body=c.body, read=read, cancel=cancel,
                            priority=c.priority)
    from streamquake.loadgen.trace import read_prompts

    # The rows travel in the plan, so a load process on another host needs no copy of the file.
    rows = read_prompts(c.dataset)
    return RequestClassPlan(name=c.name, weight=c.weight, prompts=[r.prompt for r in rows],
                            prompt_max_tokens=[r.max_tokens or 0 for r in rows],
                            max_tokens=c.max_tokens, body=c.body, read=read, cancel=cancel,
                            priority=c.priority)


def _trace(spec: TraceSpec, start_at: float, processes: int, classes: set[str]) -> TraceReplay:
    """The trace's rows for the load processes. A row's ``class`` picks that request class; a
    row with none but a ``tenant`` that names a class takes that one (a class per tenant gives
    per-tenant figures and SLOs); the rest draw a class by weight."""
    from streamquake.loadgen.trace import read_trace

    rows = read_trace(spec.file, spec.speedup)
    last = rows[-1].offset_s
    # Looping keeps the trace's mean rate: the next pass starts one mean gap after the last row.
    period = last + (last / (len(rows) - 1) if len(rows) > 1 and last > 0 else 1.0)
    return TraceReplay(
        start_at=start_at,
        rows=[(r.offset_s, r.input_tokens, r.output_tokens,
               r.cls or (r.tenant if r.tenant in classes else None), r.prompt) for r in rows],
        loop=spec.loop, period_s=period, max_inflight=spec.max_inflight, processes=processes)
