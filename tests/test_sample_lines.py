"""A request sample's line (samples-<pid>.jsonl, and every report built from it): every field
of the dataclass, in its order, and read back the same."""

from __future__ import annotations

import dataclasses
import json
import math

import orjson

from streamquake.loadgen.samples import RequestSample


def test_a_sample_line_holds_every_field_in_order_and_reads_back_the_same() -> None:
    s = RequestSample(cls="chat", sent=1_700_000_000.123456, scheduled=1_700_000_000.1,
                      trace_id="a" * 32, span_id="b" * 16)
    s.ttfb_ms, s.ttft_ms, s.e2e_ms = 0.1 + 0.2, 21.000000001, 1e-7
    s.itl_ms = [20.25, 0.0, 1 / 3, 123456.789]
    s.error, s.error_detail = "protocol", 'a "quoted" \\ détail\n'
    s.finish_reason, s.usage_tokens, s.content_events = "stop", 3, 5
    line = s.to_json()
    data = json.loads(line)
    assert list(data) == [f.name for f in dataclasses.fields(RequestSample)]
    assert RequestSample.from_dict(data) == s
    # A float that is not finite (none is ever measured) is null, not a token JSON lacks.
    s.e2e_ms = math.inf
    assert json.loads(s.to_json())["e2e_ms"] is None


def test_a_line_read_back_is_the_sample_written_with_every_field_or_some() -> None:
    # A whole line takes the short way (no __init__), a line with fields missing or unknown the
    # long one: both give the sample that was written, defaults filled in.
    s = RequestSample(cls="c", sent=1.5, ttfb_ms=2.0, itl_ms=[1.0, 0.0, 2.5], error="timeout",
                      content_events=4)
    whole = orjson.loads(s.to_json())
    back = RequestSample.from_dict(whole)
    assert back == s and back.tokens_per_s == s.tokens_per_s
    some = {k: v for k, v in whole.items() if k not in ("itl_ms", "model")} | {"extra": 1}
    partial = RequestSample.from_dict(some)
    assert partial == dataclasses.replace(s, itl_ms=[], model=None)
