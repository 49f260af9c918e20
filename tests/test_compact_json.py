"""jsontypes.compact: what the scorecard's checkpoints and the request bodies are written with
reads back as json.dumps's text does, for any JSON data (non-string keys, non-ASCII text, lone
surrogates and integers past 64 bits included: orjson refuses the last two, json writes them)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from streamquake.jsontypes import compact, compact_bytes

_KEYS = st.one_of(st.text(), st.integers(-(2**63), 2**63 - 1))
_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(),
                    st.floats(allow_nan=False, allow_infinity=False), st.text())
_DATA = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(_KEYS, inner, max_size=5)), max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(_DATA)
def test_any_data_reads_back_as_json_writes_it(value: object) -> None:
    expected = json.loads(json.dumps(value, separators=(",", ":")))
    assert json.loads(compact(value)) == expected
    assert json.loads(compact_bytes(value).decode()) == expected


def test_what_orjson_refuses_is_written_by_json() -> None:
    for value in ({"reason": "bad \udc80 byte"}, [2**70], {"n": -(2**65)}):
        assert compact(value) == json.dumps(value, separators=(",", ":"))


def test_ascii_data_is_json_text_exactly() -> None:
    value = {"phase": "baseline", "class": "c0", "stats": {"sent": 3, "x": [1.5, None, True]},
             "seconds": {1: 2, 10: 3}}
    assert compact(value) == json.dumps(value, separators=(",", ":"))
