"""What the CLI tells about the tool itself: every fault type with its parameters
(``streamquake faults``) and the scenario's JSON Schema (``streamquake schema``), both read off
the pydantic models, so neither can drift from what ``validate`` accepts.

Many fields are numbers in the model that a scenario writes as text (``delay: 100ms``,
``loss: 1%``, ``rate: 8mbit``): their types (``DurationMs``, ``Fraction``, ``Rate``... in
``units.py``) convert them. Which quantity a field takes is read from the ``Unit`` its type
carries, so the listing can say "duration" and the schema can accept the string form an editor
would otherwise flag.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from streamquake.faults.catalog import families
from streamquake.faults.envelope import ENVELOPE, FaultSpec
from streamquake.faults.written import value_as_written
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.scenario.schema import Scenario
from streamquake.units import QuantityKind, quantity

# How each quantity is written; `streamquake faults` says it once, above the tables.
QUANTITIES: dict[QuantityKind, str] = {
    "duration": "a duration: 100ms, 1.5s, 1m30s, 2h (a bare number: the field's unit)",
    "percentage": "a percentage or a fraction: 15% or 0.15",
    "rate": "a rate: 8mbit (bits/s), 1mbps or 1MB/s (bytes/s)",
    "size": "a size: 32kb, 1mb or a number of bytes",
}


def _explain(kind: str) -> str:
    return "; or ".join(QUANTITIES[k] for k in QUANTITIES if k in kind.split(" or "))


def type_text(annotation: object) -> str:
    """``float | None`` -> "number (optional)"-style text for people."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is Literal:
        return " | ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args if a is not type(None))
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(type_text(a) for a in args if a is not Ellipsis)
        return f"[{inner}]"
    if origin is dict:
        return "{" + ": ".join(type_text(a) for a in args) + "}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "{" + ", ".join(f.alias or n for n, f in annotation.model_fields.items()) + "}"
    names = {str: "text", int: "integer", float: "number", bool: "true | false"}
    if isinstance(annotation, type):
        return names.get(annotation, annotation.__name__)
    return str(annotation).replace("typing.", "")


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    required: bool
    default: JsonValue
    description: str

    def to_json(self) -> JsonDict:
        return {"name": self.name, "type": self.type, "required": self.required,
                "default": self.default, "description": self.description}


def _default(info: FieldInfo) -> JsonValue:
    if info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        dumped: JsonValue = value.model_dump(mode="json", by_alias=True)
        return dumped
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    return str(value)


def params(model: type[FaultSpec]) -> list[Param]:
    out = []
    for name, info in model.model_fields.items():
        if name in ENVELOPE:
            continue
        kind = quantity(model, name)
        out.append(Param(
            name=info.alias or name,
            type=kind or type_text(info.annotation),
            required=info.is_required(),
            default=value_as_written(name, kind, _default(info)),
            description=info.description or "",
        ))
    return out


@dataclass(frozen=True)
class FaultTypeDoc:
    name: str
    family: str
    summary: str
    params: list[Param]

    def to_json(self) -> JsonDict:
        return {"type": self.name, "family": self.family, "summary": self.summary,
                "params": [p.to_json() for p in self.params]}


def fault_docs() -> list[FaultTypeDoc]:
    docs = [FaultTypeDoc(t.name, f.name, t.summary, params(t.spec))
            for f in families() for t in f.faults]
    return sorted(docs, key=lambda d: d.name)


# -- the JSON Schema ---------------------------------------------------------------------------


def _models(root: type[BaseModel]) -> Iterator[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo: list[object] = [root]
    while todo:
        item = todo.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if item in seen:
                continue
            seen.add(item)
            yield item
            todo.extend(f.annotation for f in item.model_fields.values())
        else:
            todo.extend(typing.get_args(item))


# Pydantic writes a bound that it checks after a before-validator (``rate: Rate | None =
# Field(gt=0)``) under its Python name; JSON Schema's names, in pydantic's sorted order.
_BOUNDS = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}


def _json_bounds(variant: JsonValue) -> JsonValue:
    if not isinstance(variant, dict) or not _BOUNDS.keys() & variant.keys():
        return variant
    return dict(sorted((_BOUNDS.get(k, k), v) for k, v in variant.items()))


def _accept_text(prop: JsonDict, kind: str) -> JsonDict:
    text: JsonDict = {"type": "string", "description": _explain(kind)}
    keep = {k: v for k, v in prop.items() if k in ("title", "default", "description")}
    rest = {k: v for k, v in prop.items() if k not in keep}
    options = rest.get("anyOf")
    variants = [_json_bounds(v) for v in (options if isinstance(options, list) else [rest])]
    if not any(isinstance(v, dict) and v.get("type") == "string" for v in variants):
        variants.append(text)
    return {**keep, "anyOf": variants}


def scenario_schema() -> JsonDict:
    """The scenario's JSON Schema (draft 2020-12), durations and percentages accepted as the
    text a scenario writes."""
    schema: JsonDict = Scenario.model_json_schema(by_alias=True, mode="validation")
    defs = schema.get("$defs")
    defs = defs if isinstance(defs, dict) else {}
    for model in _models(Scenario):
        node = schema if model is Scenario else defs.get(model.__name__)
        props = node.get("properties") if isinstance(node, dict) else None
        if not isinstance(props, dict):
            continue
        for name, info in model.model_fields.items():
            kind = quantity(model, name)
            prop = props.get(info.alias or name)
            if kind is not None and isinstance(prop, dict):
                props[info.alias or name] = _accept_text(prop, kind)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "streamquake scenario", **{k: v for k, v in schema.items()
                                                if k != "title"}}


