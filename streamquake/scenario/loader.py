"""YAML in, a validated Scenario out: every problem in a file at once, as
``file:line:col: field.path: message (hint)``."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError

from streamquake.errors import ScenarioError
from streamquake.scenario.schema import Scenario


def load_scenario(path: str | Path) -> Scenario:
    """Read, parse and validate a scenario file; raise ScenarioError listing every problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read the scenario file: {exc.strerror or exc}") from exc
    return parse_scenario(text, str(p))


def parse_scenario(text: str, filename: str = "<scenario>") -> Scenario:
    yaml = YAML(typ="rt")
    try:
        doc = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        raise ScenarioError(f"{where}: not valid YAML: {exc.problem}") from exc
    if not isinstance(doc, CommentedMap):
        raise ScenarioError(f"{filename}:1:1: a scenario is a mapping with 'name', 'target', "
                            "'phases' (and usually 'load', 'faults', 'slos')")
    try:
        return Scenario.model_validate(_plain(doc))
    except ValidationError as exc:
        raise ScenarioError(_format_errors(exc, doc, filename)) from exc


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, bool):
        return bool(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


def _locate(doc: Any, loc: tuple[Any, ...]) -> tuple[int, int, list[str]]:
    """Walk the YAML along a pydantic error location: (line, col, yaml path found)."""
    node, line, col, path = doc, 1, 1, []
    for part in loc:
        if isinstance(node, CommentedMap) and isinstance(part, str) and part in node:
            ln, cl = node.lc.key(part)
            line, col, node = ln + 1, cl + 1, node[part]
            path.append(part)
        elif isinstance(node, CommentedSeq) and isinstance(part, int) and part < len(node):
            ln, cl = node.lc.item(part)
            line, col, node = ln + 1, cl + 1, node[part]
            path.append(str(part))
        # Anything else is a union tag or validator name that has no place in the YAML.
    return line, col, path


def _format_errors(exc: ValidationError, doc: Any, filename: str) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        line, col, path = _locate(doc, loc)
        field = ".".join(path) or "(top level)"
        kind = err["type"]
        if kind == "missing":
            missing = str(loc[-1])
            field = ".".join([*path, missing])
            msg = "required field is missing"
            hint = f"add '{missing}:' here"
        elif kind == "extra_forbidden":
            msg = "unknown field"
            hint = _spelling_hint(loc)
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            hint = _HINTS.get(kind, "")
        suffix = f" (hint: {hint})" if hint else ""
        problems.append(f"{filename}:{line}:{col}: {field}: {msg}{suffix}")
    return problems


def _spelling_hint(loc: tuple[Any, ...]) -> str:
    model = _model_at(Scenario, loc[:-1])
    if model is None:
        return "remove it"
    allowed = sorted(_field_names(model))
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f"did you mean '{close[0]}'? allowed here: {', '.join(allowed)}"
    return f"remove it; allowed here: {', '.join(allowed)}"


def _field_names(model: type[BaseModel]) -> dict[str, str]:
    """YAML key -> python attribute name."""
    return {(f.alias or name): name for name, f in model.model_fields.items()}


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class an error location points into (union tags and list indexes skipped)."""
    current: Any = model
    for part in loc:
        candidates = _models_in(current)
        tagged = [m for m in candidates if _tag_of(m) == part]
        if tagged:
            current = tagged[0]
            continue
        owners = [m for m in candidates if part in _field_names(m)]
        if owners:
            current = owners[0].model_fields[_field_names(owners[0])[part]].annotation
    found = _models_in(current)
    return found[0] if found else None


def _models_in(tp: Any) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in typing.get_args(tp) for m in _models_in(arg)]


def _tag_of(model: type[BaseModel]) -> str | None:
    for key in ("type", "dist", "mode"):
        f = model.model_fields.get(key)
        if f is not None:
            args = typing.get_args(f.annotation)
            if len(args) == 1:
                return str(args[0])
    return None


_HINTS = {
    "literal_error": "use one of the values listed",
    "union_tag_invalid": "use one of the values listed",
    "union_tag_not_found": "add 'type:' naming the kind of fault",
    "int_parsing": "write a whole number",
    "int_from_float": "write a whole number",
    "float_parsing": "write a number",
    "bool_parsing": "write true or false",
    "greater_than": "use a bigger value",
    "greater_than_equal": "use a bigger value",
    "less_than_equal": "use a smaller value",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list (lines starting with '- ')",
    "model_type": "write a mapping (key: value lines)",
}
