"""``streamquake capacity``: the highest rate at which the scenario's SLOs hold."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from streamquake.cli.base import (
    CAPACITY_EXIT_CODES_HELP,
    app,
    check_out_dir,
    console,
    duration_option,
    read_scenario,
    share_option,
)
from streamquake.errors import ScenarioError


@app.command(epilog=CAPACITY_EXIT_CODES_HELP)
def capacity(
    scenario_file: Annotated[Path, typer.Argument(help="Scenario YAML file (its target, load, "
                                                  "faults and SLOs).")],
    faults: Annotated[list[str] | None, typer.Option("--fault", help="A fault to hold, by "
                                                     "name (repeatable; default: each of the "
                                                     "scenario's).")] = None,
    start: Annotated[float | None, typer.Option("--start", help="The first rate (requests/s; "
                                                "default: load.arrival.rate, or 1).")] = None,
    precision: Annotated[str, typer.Option("--precision", help="Stop when the lowest failing "
                                           "rate is within this of the highest passing one.")
                         ] = "10%",
    max_probes: Annotated[int, typer.Option("--max-probes", help="Probes per condition at "
                                            "most.", min=1)] = 10,
    budget: Annotated[str, typer.Option("--budget", help="Time for the whole search, shared "
                                        "by the conditions.")] = "10m",
    warmup: Annotated[str, typer.Option("--warmup", help="Each probe's warm-up (an unstable "
                                        "queue builds up in it).")] = "5s",
    probe_time: Annotated[str, typer.Option("--probe", help="Each probe's measured step.")
                          ] = "20s",
    out: Annotated[Path, typer.Option("--out", help="Directory for capacity.json, summary.md, "
                                      "report.html and each probe's run.")
                   ] = Path("out-capacity"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override one scenario "
                                                        "field first (repeatable).")] = None,
    lease: Annotated[str, typer.Option("--lease", help="The watchdog's lease (as in run).")
                     ] = "10s",
    no_watchdog: Annotated[bool, typer.Option("--no-watchdog", help="Hold faults without the "
                                              "local agent's lease (as in run).")] = False,
) -> None:
    """Find the highest arrival rate at which the scenario's SLOs hold: with no fault, then
    with each fault held alone; print each capacity with its bracket, the share of the
    no-fault capacity each fault leaves, and each probe's goodput (the requests that met every
    SLO) with each condition's knee; write capacity.json, summary.md and report.html."""
    from streamquake.run.capacity_search import SearchPlan
    from streamquake.sessions.capacity import search_and_report

    plan = SearchPlan(
        faults=tuple(faults) if faults else None, start=start,
        precision=share_option(precision, "--precision"), max_probes=max_probes,
        budget_s=duration_option("--budget", budget),
        warmup_s=duration_option("--warmup", warmup),
        probe_s=duration_option("--probe", probe_time),
        lease_s=None if no_watchdog else duration_option("--lease", lease))
    if start is not None and start <= 0:
        raise ScenarioError(f"--start {start:g}: give a rate above 0 requests/s")
    text = read_scenario(scenario_file)
    check_out_dir(out)
    raise typer.Exit(search_and_report(scenario_file, text, overrides or [], out, plan,
                                       console))


