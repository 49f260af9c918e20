"""Every path of every shipped scenario, given a value of every wrong type (issue 20): the
loader answers with a Scenario or a located ScenarioError, never another exception; and what
it accepts goes through ``run --dry-run``'s plan and the load plan's serialisation without one.

The values: null, booleans, empty and full lists and mappings, infinities and NaN, numbers far
out of range, a long string, a lone surrogate, control and format characters, the empty string.
Written as JSON (which is YAML), so each document is exactly the mutated value.

Profiles (``STREAMQUAKE_FUZZ_PROFILE``, as tests/test_fuzz.py): ``nightly`` (``scripts/fuzz``)
gives every path every wrong value; ``ci`` (the default) every path one value of each kind
(null, a boolean, a list, a mapping, a non-finite number, a number out of range, a string),
taking the kinds' values in turn from path to path, so that every value is still given to
many paths of each scenario: a quarter of the documents (the loader's YAML reading, pure
Python for its positions, takes ~9 ms a document: 226 s of CPU for all 17 scenarios in the
nightly profile on 2 cores, about a quarter of it in the ci one)."""

from __future__ import annotations

import copy
import json
import math
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from streamquake.errors import ScenarioError, StreamquakeError
from streamquake.run.dry_run import dry_run_plan
from streamquake.run.load_from_scenario import load_plan_for
from streamquake.scenario import parse_scenario
from tests.conftest import REPO
from tests.helpers import NIGHTLY

WRONG: list[Any] = [None, True, False, [], {}, [1, "a"], {"a": 1}, math.inf, -math.inf,
                    math.nan, 2**70, -2**70, -1, 0, 1e-300, "x" * 5000, "\ud800",
                    "a\x07\u202eb\x00", "", "1e309",
                    # Quoted numbers too big to be numbers, and the edge of a unit's range
                    # (issue 37): each field's own parser bounds them, every field alike.
                    "inf", "nan", "9" * 400, "9" * 400 + "ms", 2**32, 2**63 - 1, "1us"]
SHIPPED = sorted((REPO / "scenarios").glob("*.yaml"))
# The values by kind: the ci profile gives each path one of each kind, in turn.
KINDS: list[list[Any]] = [
    [None], [True, False], [[], [1, "a"]], [{}, {"a": 1}], [math.inf, -math.inf, math.nan],
    [2**70, -2**70, -1, 0, 1e-300, 2**32, 2**63 - 1],
    [v for v in WRONG if isinstance(v, str)],
]
assert sorted(map(repr, WRONG)) == sorted(repr(v) for kind in KINDS for v in kind)


def _values(i: int) -> list[Any]:
    """The wrong values the ``i``-th path of a scenario is given in this profile."""
    if NIGHTLY:
        return WRONG
    return [kind[i % len(kind)] for kind in KINDS]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


def _with(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _yaml(value: Any) -> str:
    text = json.dumps(value, allow_nan=True)     # JSON is YAML; its non-finite words are not
    return text.replace("-Infinity", "-.inf").replace("Infinity", ".inf").replace("NaN", ".nan")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_path_of_a_shipped_scenario_with_every_wrong_value(path: Path) -> None:
    doc = json.loads(json.dumps(YAML(typ="safe", pure=True).load(path.read_text())))
    counts = {"documents": 0, "refused": 0, "accepted": 0}
    tracebacks: list[str] = []
    given: set[str] = set()
    for i, where in enumerate(_paths(doc)):
        for value in _values(i):
            given.add(repr(value))
            counts["documents"] += 1
            text = _yaml(_with(doc, where, value))
            try:
                scenario = parse_scenario(text, str(path))
            except ScenarioError as exc:
                counts["refused"] += 1
                assert all(p.startswith(str(path)) for p in exc.problems), exc.problems
                continue
            except Exception:      # noqa: BLE001 - what the test looks for
                tracebacks.append(f"{where} = {value!r:.40}: {traceback.format_exc()[-400:]}")
                continue
            counts["accepted"] += 1
            try:
                dry_run_plan(scenario)
                load_plan_for(scenario, "http://127.0.0.1:9", Path("/nonexistent"),
                              time.time() + 60).model_dump_json()
            except StreamquakeError:
                pass
            except Exception:      # noqa: BLE001
                tracebacks.append(f"{where} = {value!r:.40} (accepted): "
                                  f"{traceback.format_exc()[-400:]}")
    print(f"\n{path.name}: {counts}, tracebacks {len(tracebacks)}")
    assert not tracebacks, "\n".join(tracebacks[:5])
    assert counts["refused"] > counts["accepted"] > 0
    assert given == {repr(v) for v in WRONG}     # every value, to some path of this scenario
