"""Turn a validated scenario into the load process's plan (the only bridge between the two)."""

from __future__ import annotations

from pathlib import Path

from streamquake.loadgen.plan import ClosedLoop, LoadPlan, OpenLoop, RequestClassPlan
from streamquake.scenario import Scenario


def load_plan_for(scenario: Scenario, base_url: str, samples_dir: Path, end_at: float) -> LoadPlan:
    load, target = scenario.load, scenario.target
    arrival: ClosedLoop | OpenLoop
    if load.arrival is not None:
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
        users=load.users,
        spawn_rate=load.spawn_rate or float(load.users),
        arrival=arrival,
        classes=[
            RequestClassPlan(
                name=c.name, weight=c.weight, prompts=c.prompt_list, max_tokens=c.max_tokens,
                body=c.body,
            )
            for c in load.classes
        ],
        samples_path=str(samples_dir),
        seed=load.seed,
        end_at=end_at,
        retries=load.retries,
        max_line_bytes=load.limits.line_bytes,
        max_event_bytes=load.limits.event_bytes,
        max_data_lines=load.limits.data_lines,
    )
