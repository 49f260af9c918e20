"""Issue 37.12: degenerate input gives no verdict of its own.

A server's usage that is not a count is no usage; a recovery window or fault step too short to
hold a request is refused where it is written; an output length range that is empty or unbounded
is refused.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from streamquake import protocols
from streamquake.loadgen.sse_parser import SSEParser
from streamquake.protocols import Completion, Protocol
from tests.conftest import run_cli

NAMES = typing.get_args(Protocol)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("count", [-50, -1, 2**63])
@pytest.mark.parametrize("name", NAMES)
def test_a_usage_count_that_is_not_a_count_is_no_usage(name: str, count: int) -> None:
    wire = protocols.get(name)
    request = wire.parse(wire.body("m-1", "a short prompt", 64), "m-1")
    enc = wire.encoder(request, False)
    raw = (enc.opening() + enc.token(json.dumps("hi").encode())
           + enc.closing(Completion(count, False)))
    assert str(count).encode() in raw  # the server really says it
    decoded = [wire.decode(e) for e in SSEParser().feed(raw)]
    assert decoded[-1].done
    assert [d.usage_output_tokens for d in decoded if d.usage_output_tokens is not None] == []
    # The same stream with a true count reads it back: the test can tell the two apart.
    good = (enc.opening() + enc.token(json.dumps("hi").encode())
            + enc.closing(Completion(7, False)))
    assert 7 in [wire.decode(e).usage_output_tokens for e in SSEParser().feed(good)]


_SCENARIO = """name: degenerate
target:
  protocol: openai
  embedded: {{output_tokens: {output}}}
{timeline}
{recovery}
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("output, timeline, recovery, line, words", [
    ("{min: 9223372036854775807, max: 8}", "phases: {baseline: 5s, fault: 0s, recovery: 0s}", "",
     4, "output_tokens.min"),
    ("{min: 900, max: 8}", "phases: {baseline: 5s, fault: 0s, recovery: 0s}", "",
     4, "'min' (900) is more than 'max' (8)"),
    ("{min: 8, max: 8}", "phases: {baseline: 5s, fault: 1us, recovery: 1s}", "",
     5, "phases.fault: 0.001ms is too short for a phase"),
    ("{min: 8, max: 8}", "phases: {baseline: 5s, fault: 0s, recovery: 0s}",
     "recovery: {window: 1us}", 6, "recovery.window: 0.001ms is too short"),
    ("{min: 8, max: 8}", "steps:\n  - {name: b, kind: baseline, duration: 2s}\n"
     "  - {name: f, kind: fault, duration: 1us}", "", 7, "duration: 0.001ms is too short for a "
     "step"),
])
def test_degenerate_settings_are_refused_where_they_are_written(
        tmp_path: Path, output: str, timeline: str, recovery: str, line: int,
        words: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(_SCENARIO.format(output=output, timeline=timeline, recovery=recovery))
    done = run_cli("validate", str(path), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"{path}:{line}:" in done.stderr and words in done.stderr, done.stderr
    assert "give at least 100ms" in done.stderr or "output_tokens" in done.stderr


@pytest.mark.timeout(60)
def test_the_shortest_accepted_settings_still_validate(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(_SCENARIO.format(output="{min: 1, max: 1000000}",
                                     timeline="phases: {baseline: 100ms, fault: 0s, "
                                     "recovery: 100ms}", recovery="recovery: {window: 100ms}"))
    done = run_cli("validate", str(path), timeout=60)
    assert done.returncode == 0, done.stderr
