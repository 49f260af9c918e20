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

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from streamquake.faults.catalog import families
from streamquake.faults.envelope import ENVELOPE, FaultSpec
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.units import (
    QuantityKind,
    format_ms,
    format_percent,
    format_rate,
    format_size,
    unit_of,
)

# How each quantity is written; `streamquake faults` says it once, above the tables.
QUANTITIES: dict[QuantityKind, str] = {
    "duration": "a duration: 100ms, 1.5s, 1m30s, 2h (a bare number: the field's unit)",
    "percentage": "a percentage or a fraction: 15% or 0.15",
    "rate": "a rate: 8mbit (bits/s), 1mbps or 1MB/s (bytes/s)",
    "size": "a size: 32kb, 1mb or a number of bytes",
}


def quantity(model: type[BaseModel], field: str) -> str | None:
    """The text form(s) a field's type accepts ("duration", "percentage or duration"...), if
    any."""
    info = model.model_fields[field]
    unit = unit_of(info.annotation, info.metadata)
    return None if unit is None else " or ".join(k for k in QUANTITIES if k in unit.kinds)


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


def _as_written(field: str, kind: str | None, value: JsonValue) -> JsonValue:
    """A value as a scenario would write it: 50.0 in ``latency_ms`` is ``50ms``, 25000.0 in
    ``rate_bytes_per_s`` is ``200kbit``."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return value
    if kind == "duration":
        return format_ms(value if field.endswith("_ms") else value * 1000)
    if kind == "percentage":
        return format_percent(value)
    if kind == "rate":
        return format_rate(value)
    if kind == "size":
        return format_size(value)
    return value


def written_pairs(model: BaseModel, skip: tuple[str, ...] = ENVELOPE,
                  only_given: bool = False) -> list[tuple[str, str]]:
    """For people: a model's fields that are set (``only_given``: those the scenario gave), in
    their units as a scenario writes them, nested ones dotted: ``[("delay", "400ms"),
    ("rate", "200kbit"), ("stall.probability", "1%")]``."""
    out: list[tuple[str, str]] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if name in skip or value is None or (only_given and name not in model.model_fields_set):
            continue
        key = info.alias or name
        if isinstance(value, BaseModel):
            out += [(f"{key}.{k}", v) for k, v in written_pairs(value, (), only_given)]
            continue
        shown = _as_written(name, quantity(type(model), name), value)
        out.append((key, shown if isinstance(shown, str) else json.dumps(shown)))
    return out


def settings_text(spec: FaultSpec) -> str:
    """``rate=200kbit, latency=20ms``: what the scenario (or ``inject``) set, in its units."""
    return ", ".join(f"{k}={v}" for k, v in written_pairs(spec, only_given=True)) or "defaults"


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
            default=_as_written(name, kind, _default(info)),
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
    from streamquake.scenario import Scenario

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


# -- a spec back as a scenario writes it -------------------------------------------------------


def _written(model: BaseModel) -> JsonDict:
    out: JsonDict = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None:
            continue
        key = info.alias or name
        if isinstance(value, BaseModel):
            out[key] = _written(value)
        elif quantity(type(model), name) == "rate" and isinstance(value, int | float):
            # The model holds bytes/s; its validator wants a unit ("bps" is bytes/s in tc's
            # convention), and refuses a bare number as ambiguous.
            out[key] = f"{float(value)!r}bps"
        else:
            dumped: JsonDict = model.model_dump(mode="json", by_alias=True, include={name})
            out[key] = dumped[key]
    return out


def as_written(spec: FaultSpec) -> JsonDict:
    """``spec`` as a scenario could write it, so that validating it again (on an agent, say)
    gives the same spec: pydantic's plain dump holds converted values (a rate in bytes/s) that
    some before-validators do not take back."""
    return _written(spec)
