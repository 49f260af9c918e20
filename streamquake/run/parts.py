"""The run's parts: the run-long resources the fault families ask for, the target (embedded or
a URL), and the load generator. Everything started here is stopped by the caller's ExitStack."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from streamquake.errors import PreflightError
from streamquake.faults.catalog import families
from streamquake.faults.contract import Resource, RunContext, Wiring
from streamquake.journal import Journal
from streamquake.jsontypes import JsonDict
from streamquake.loopback import is_loopback
from streamquake.run.events import Events
from streamquake.run.launcher import BEGIN_AFTER_READY_S, LocustRun, start_load
from streamquake.run.timeline import REMOTE_LEAD_S, PhaseWindow, plan_windows
from streamquake.scenario import Scenario


@dataclass
class Parts:
    ctx: RunContext
    wiring: Wiring
    resources: list[Resource] = field(default_factory=list)
    target_info: JsonDict = field(default_factory=dict)

    def reports(self) -> JsonDict:
        out: JsonDict = {}
        for r in self.resources:
            report = r.report()
            if report is not None:
                out[r.key] = report
        return out


def wanted_resources(scenario: Scenario) -> list[Resource]:
    found: dict[str, Resource] = {}
    for family in families():
        for r in family.resources(scenario):
            found.setdefault(r.key, r)
    if scenario.agents:
        # Faults held by agents on other hosts (``at: NAME``): the scenario's agents, checked
        # once in preflight and reported under ``telemetry.agents``.
        from streamquake.run.remote import AgentDirectory

        directory = AgentDirectory(scenario.agents)
        found.setdefault(directory.key, directory)
    return list(found.values())


def start_parts(stack: contextlib.ExitStack, scenario: Scenario, run_dir: Path,
                journal: Journal, events: Events,
                check_lease: Callable[[], None] = lambda: None) -> Parts:
    """``check_lease`` raises unless the run's lease holds: called before each resource, as
    each changes the system (a namespace, a proxy)."""
    wiring = Wiring()
    ctx = RunContext(target_host="", target_port=0, run_dir=run_dir, network=scenario.network,
                     seed=scenario.load.seed, journal=journal)
    parts = Parts(ctx, wiring)
    resources = wanted_resources(scenario)
    for r in (r for r in resources if r.stage == "before_target"):
        check_lease()
        _start(stack, r, parts, events)
    _start_target(stack, scenario, parts, events)
    for r in (r for r in resources if r.stage == "after_target"):
        check_lease()
        _start(stack, r, parts, events)
    if wiring.load_url != wiring.target_url:
        parts.target_info["load_url"] = wiring.load_url
    ctx.target_netns = wiring.target_netns
    return parts


def _start(stack: contextlib.ExitStack, resource: Resource, parts: Parts,
           events: Events) -> None:
    events.message(f"starting {resource.title}")
    stack.callback(resource.stop)
    resource.start(parts.ctx, parts.wiring)
    parts.resources.append(resource)
    parts.ctx.resources.append(resource)


def _start_target(stack: contextlib.ExitStack, scenario: Scenario, parts: Parts,
                  events: Events) -> None:
    spec, wiring = scenario.target, parts.wiring
    if spec.embedded is not None:
        from streamquake.embedded.process import start_target

        events.message("starting the embedded target")
        target = stack.enter_context(start_target(
            spec.embedded, host=wiring.target_bind_host,
            cmd_prefix=wiring.target_cmd_prefix or None,
            log_path=parts.ctx.run_dir / "target.log",
        ))
        wiring.target_url = target.url
        parts.target_info.update({"kind": "embedded", "url": target.url,
                                  "config": spec.embedded.model_dump(mode="json")})
    else:
        assert spec.url is not None
        wiring.target_url = spec.url
        check_reachable(spec.url, spec.connect_timeout_s)
        parts.target_info.update({"kind": "url", "url": spec.url})
    wiring.load_url = wiring.target_url
    url = urlsplit(wiring.target_url)
    parts.ctx.target_host = url.hostname or "127.0.0.1"
    parts.ctx.target_port = url.port or (443 if url.scheme == "https" else 80)


def check_reachable(url: str, timeout_s: float) -> None:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise PreflightError(
            f"target {parts.scheme}://{parts.hostname}:{port} is unreachable "
            f"({exc.strerror or exc}); is it running, and is the URL right?"
        ) from exc


def _check_remote_reach(scenario: Scenario, load_url: str) -> None:
    """Workers on other hosts send to the same URL as local ones: not to this host's loopback."""
    load = scenario.load
    bind_host = load.master_bind.rpartition(":")[0].strip("[]")
    host = urlsplit(load_url).hostname or ""
    if load.remote_workers and not is_loopback(bind_host) and is_loopback(host):
        raise PreflightError(
            f"load.remote_workers: workers on other hosts would send to {load_url}, which is "
            "this host's loopback (the embedded target and the SSE proxy listen there); give "
            "target.url an address they can reach, and hold faults on that path with an agent "
            "(at: NAME) instead of sse_proxy")


def start_loadgen(stack: contextlib.ExitStack, scenario: Scenario, parts: Parts,
                  events: Events) -> tuple[LocustRun, list[PhaseWindow]]:
    """Locust's processes, and the steps' windows: the first opens once they are up."""
    _check_remote_reach(scenario, parts.wiring.load_url)
    events.message("starting the load generator (Locust)")
    run, windows = start_load(
        scenario, base_url=parts.wiring.load_url, work_dir=parts.ctx.run_dir,
        windows_from=lambda t0: plan_windows(scenario, t0),
        least_lead_s=REMOTE_LEAD_S if scenario.load.remote_workers else 0.0)
    stack.callback(run.stop)
    if run.up is not None:
        up, took = run.up
        said = f"{up} of {len(run.pids)}" if up < len(run.pids) else str(up)
        events.message(f"load generator: {said} Locust process(es) up in {took:.1f} s; the "
                       f"first step opens {BEGIN_AFTER_READY_S:g} s after")
    return run, windows
