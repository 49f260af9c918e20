"""A scenario file in, a validated ``Scenario`` out (the YAML reading with positions, limits and
located errors is ``located_yaml``): ``--set`` overrides applied, data files resolved and
checked against the plan."""

from __future__ import annotations

from pathlib import Path

from streamquake.located_yaml import parse_yaml, read_file, validate
from streamquake.scenario import datafiles
from streamquake.scenario.overrides import apply_overrides
from streamquake.scenario.schema import Scenario

_SCENARIO_SHAPE = ("a scenario is a mapping with 'name', 'target', 'phases' "
                   "(and usually 'load', 'faults', 'slos')")


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, parse and validate a scenario file, with ``--set KEY=VALUE`` overrides applied;
    raise ScenarioError listing every problem."""
    p = Path(path)
    return parse_scenario(read_file(p, "scenario file"), str(p), overrides)


def parse_scenario(text: str | bytes, filename: str = "<scenario>",
                   overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    doc = apply_overrides(parse_yaml(text, filename), overrides)
    files = datafiles.resolve(doc, filename)
    scenario = validate(Scenario, doc, filename, _SCENARIO_SHAPE)
    trace = scenario.load.trace
    datafiles.check(files, filename, trace.speedup if trace is not None else 1.0,
                    tuple(c.name for c in scenario.load.classes))
    return scenario
