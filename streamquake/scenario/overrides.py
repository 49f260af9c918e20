"""``--set load.users=50``: change one field of a scenario from the command line.

The path is dotted field names, with list items by index (``faults.0.delay=80ms``) or by name
(``faults.chunk-drop.drop=20%``, ``steps.f-slow.duration=20s``); the value is
read with the same YAML reader as the file, so ``--set load.think_time={min: 1s, max: 2s}`` and
``--set target.embedded.ttft=50ms`` work, and missing mappings on the way are created. The
result is validated like the file, and a problem in an overridden value names the ``--set``
that brought it instead of a line of the file.
"""

from __future__ import annotations

from streamquake.errors import ScenarioError
from streamquake.jsontypes import JsonValue
from streamquake.located_yaml import Pos, YamlDoc, parse_yaml


def parse_override(item: str) -> tuple[list[str | int], str]:
    """``a.b.0=v`` -> (["a", "b", 0], "v")."""
    path_text, sep, value = item.partition("=")
    path_text = path_text.strip()
    if not sep or not path_text:
        raise ScenarioError(f"--set {item}: write KEY=VALUE, e.g. --set load.users=50")
    path: list[str | int] = []
    for part in path_text.split("."):
        if not part:
            raise ScenarioError(f"--set {item}: '{path_text}' has an empty part; write "
                                "dotted field names, e.g. load.users or faults.0.delay")
        if part.isascii() and part.isdigit():
            if len(part) > 9:
                raise ScenarioError(f"--set {item[:80]}: list index '{part[:20]}...' has "
                                    f"{len(part)} digits; a list index is a small number, "
                                    "e.g. faults.0.delay")
            path.append(int(part))
        elif not part.isascii() and any(c.isdigit() for c in part):
            raise ScenarioError(f"--set {item[:80]}: '{part}' is not a field name or a list "
                                "index; write ASCII digits for an index, e.g. faults.0.delay")
        else:
            path.append(part)
    return path, value


def apply_overrides(doc: YamlDoc, overrides: list[str] | tuple[str, ...]) -> YamlDoc:
    """``doc`` with each override set in turn (later ones win); raises ScenarioError."""
    if not overrides:
        return doc
    if not isinstance(doc.value, dict):
        return doc     # validation says what is wrong with the file itself
    for item in overrides:
        path, text = parse_override(item)
        source = f"--set {item}"
        parsed = parse_yaml(text, source)
        _mark(parsed.pos, source)
        _set(doc.value, doc.pos, path, parsed.value, parsed.pos, item)
    return doc


def _mark(pos: Pos, source: str) -> None:
    pos.source = source
    for _, _, child in (pos.keys or {}).values():
        _mark(child, source)
    for child in pos.items or []:
        _mark(child, source)


def _set(value: JsonValue, pos: Pos, path: list[str | int], new: JsonValue, new_pos: Pos,
         item: str) -> None:
    walked: list[str] = []
    for i, part in enumerate(path):
        last = i == len(path) - 1
        where = ".".join(walked) or "the scenario"
        if isinstance(value, dict):
            key = str(part)
            if pos.keys is None:
                pos.keys = {}
            if last:
                value[key] = new
                pos.keys[key] = (new_pos.line, new_pos.col, new_pos)
                return
            if value.get(key) is None:      # missing on the way: create the mapping
                value[key] = {}
                pos.keys[key] = (0, 0, Pos(0, 0, keys={}, source=f"--set {item}"))
            value = value[key]
            pos = pos.keys[key][2] if key in pos.keys else Pos(0, 0)
        elif isinstance(value, list):
            if isinstance(part, str):
                part = _named_item(value, part, where, item)
            if not isinstance(part, int) or not 0 <= part < len(value):
                raise ScenarioError(f"--set {item}: {where} is a list of {len(value)}: write an "
                                    f"index from 0 to {len(value) - 1} after '{where}.'")
            if last:
                value[part] = new
                if pos.items is not None and part < len(pos.items):
                    pos.items[part] = new_pos
                return
            value = value[part]
            pos = pos.items[part] if pos.items is not None and part < len(pos.items) \
                else Pos(0, 0)
        else:
            raise ScenarioError(f"--set {item}: {where} is {_kind(value)}, not a mapping or a "
                                f"list, so it has no '{part}'")
        walked.append(str(part))


def _named_item(items: list[JsonValue], name: str, where: str, item: str) -> int:
    """The index of the item of ``items`` named ``name`` (its ``name:``, or for an unnamed
    fault its ``type:``, the name it goes by): ``faults.chunk-drop.drop=20%``."""
    names = [(i.get("name") if i.get("name") is not None else i.get("type"))
             if isinstance(i, dict) else None for i in items]
    found = [k for k, n in enumerate(names) if n == name]
    if len(found) == 1:
        return found[0]
    known = ", ".join(str(n) for n in names if n is not None) or "none"
    if found:
        raise ScenarioError(f"--set {item}: {len(found)} items of {where} are named '{name}': "
                            f"write the index instead, e.g. {where}.{found[0]}")
    raise ScenarioError(f"--set {item}: {where} has no item named '{name}' (named: {known}); "
                        f"write a name or an index from 0 to {len(items) - 1}")


def _kind(value: JsonValue) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"the value {value!r}"
