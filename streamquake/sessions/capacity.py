"""``streamquake capacity`` end to end: the scenario read, the search run, its outputs printed
and written."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from streamquake.reports.capacity_report import print_capacity, write_capacity_reports
from streamquake.run.capacity_search import SearchPlan, search_capacity
from streamquake.scenario import parse_scenario


def search_and_report(scenario_file: Path, text: bytes, overrides: list[str], out: Path,
                      plan: SearchPlan, console: Console) -> int:
    """Search, print, write; the process's exit code (the probe runs' own when interrupted)."""
    scenario = parse_scenario(text, str(scenario_file), overrides)
    result = search_capacity(scenario, str(scenario_file), out, plan,
                             lambda line: console.print(line, markup=False, highlight=False,
                                                        soft_wrap=True))
    print_capacity(result, console)
    for path in write_capacity_reports(result, out):
        console.print(f"wrote {path}", highlight=False)
    return result.exit_code
