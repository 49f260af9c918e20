"""A request sample's line (samples-<pid>.jsonl, and every report built from it): every field
of the dataclass, in its order, and read back the same."""

from __future__ import annotations

import dataclasses
import json
import math

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
