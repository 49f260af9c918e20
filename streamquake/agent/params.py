"""Fault parameters on the command line: ``k=v`` words, each value read as YAML, so they read
as they would in a scenario (``drop=15%``, ``delay=100ms``, ``sm_clocks_mhz=[500,800]``,
``stall.probability=1%`` for nested fields)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import JsonValue
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from streamquake.errors import ScenarioError


def _value(text: str) -> JsonValue:
    if text == "":
        return ""
    try:
        loaded = YAML(typ="safe", pure=True).load(text)
    except YAMLError:
        return text
    if loaded is None or isinstance(loaded, str | int | float | bool | list | dict):
        return loaded
    return text       # a date or a timestamp, say: keep what was written


def parse_assignments(type_name: str, words: Sequence[str]) -> dict[str, JsonValue]:
    """``("netem", ["delay=100ms", "loss=1%"])`` -> ``{type: netem, delay: 100ms, loss: 1%}``."""
    fault: dict[str, JsonValue] = {"type": type_name}
    problems = []
    for word in words:
        key, sep, raw = word.partition("=")
        if not sep or not key.strip():
            problems.append(f"{word!r}: write parameters as key=value, e.g. delay=100ms")
            continue
        *parents, leaf = key.strip().split(".")
        node = fault
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"{word!r}: {part} is already a value, not a group")
                break
            node = child
        else:
            node[leaf] = _value(raw)
    if problems:
        raise ScenarioError(problems)
    return fault
