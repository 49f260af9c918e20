"""JSON values as types: what faults, resources and reports exchange."""

from __future__ import annotations

import json
from typing import TypeAlias

import orjson

JsonValue: TypeAlias = "str | int | float | bool | None | list[JsonValue] | dict[str, JsonValue]"
JsonDict: TypeAlias = "dict[str, JsonValue]"


def compact_bytes(value: object) -> bytes:
    """``json.dumps(value, separators=(",", ":"))``'s data as UTF-8, written by orjson (16x
    quicker for a scorecard's cell): keys that are not strings are written as strings, as json
    writes them. What orjson refuses (a lone surrogate, an integer past 64 bits) is written by
    json. Non-ASCII text is written as UTF-8, not escaped: the same data to any JSON reader."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


def compact(value: object) -> str:
    """:func:`compact_bytes` as text."""
    return compact_bytes(value).decode()
