"""A fault's settings written back as a scenario writes them: for people (``rate=200kbit,
latency=20ms`` in reports, the dry run and the agent's listings) and for machines (a spec sent to
an agent, validated there again to the same spec). Each field's unit comes from its type
(``units.py``)."""

from __future__ import annotations

import json

from pydantic import BaseModel

from streamquake.faults.envelope import ENVELOPE, FaultSpec
from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.units import format_ms, format_percent, format_rate, format_size, quantity


def value_as_written(field: str, kind: str | None, value: JsonValue) -> JsonValue:
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
        if value is False and info.default is False and name not in model.model_fields_set:
            continue    # a switch left off says nothing: ``drop_usage=false`` on every line
        key = info.alias or name
        if isinstance(value, BaseModel):
            out += [(f"{key}.{k}", v) for k, v in written_pairs(value, (), only_given)]
            continue
        shown = value_as_written(name, quantity(type(model), name), value)
        out.append((key, shown if isinstance(shown, str) else json.dumps(shown)))
    return out


def settings_text(spec: FaultSpec) -> str:
    """``rate=200kbit, latency=20ms``: what the scenario (or ``inject``) set, in its units."""
    return ", ".join(f"{k}={v}" for k, v in written_pairs(spec, only_given=True)) or "defaults"


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
