"""Property-based fuzzing (hypothesis) of the two parsers that read what others wrote.

* The scenario loader: any bytes give a Scenario or a ScenarioError whose every line is
  ``file:line:col: message`` (or ``file: message``), never another exception, in bounded time;
  documents written as JSON (which is YAML) load as the values they hold.
* The SSE parser: every way of splitting a stream into reads gives the events a plain,
  whole-buffer reading of the WHATWG algorithm gives; arbitrary bytes raise nothing but
  SSELimitError, exactly when a limit is broken.

Profiles: ``ci`` (default: a few hundred examples per test, derandomized so CI is stable) and
``nightly`` (``STREAMQUAKE_FUZZ_PROFILE=nightly``, 10,000 per test, a new random seed each run;
``scripts/fuzz`` runs it).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamquake.errors import ScenarioError
from streamquake.loadgen.sse_parser import SSEEvent, SSELimitError, SSELimits, SSEParser
from streamquake.located_yaml import MAX_NUMBER, parse_yaml
from streamquake.scenario import parse_scenario
from tests.conftest import REPO
from tests.helpers import NIGHTLY
from tests.timing import cpu_s

EXAMPLES = 10_000 if NIGHTLY else 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,                 # time is asserted in the tests (CPU time, against a baseline)
    database=None,                 # nothing written into the checkout
    derandomize=not NIGHTLY,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.large_base_example],
)
TIMEOUT = 7200 if NIGHTLY else 400    # hang-only: 120 s was reached at load average 12
# Bounded time per input, in CPU time (competing load does not count) against what the loader
# takes for the largest seed scenario, measured in this run (a slower machine is slower at
# both) and scaled by size: the CI profile's inputs take at most ~1.5 times it; an input that
# blows up (aliases expanded, backtracking) takes thousands of times more.
PER_INPUT_FACTOR = 1000

# --------------------------------------------------------------------------- the loader

SEEDS = [p.read_bytes() for p in sorted([*(REPO / "scenarios").glob("*.yaml"),
                                         *(REPO / "tests" / "scenarios").rglob("*.yaml")])]
# Pieces of YAML that reach the loader's corners: anchors, aliases, merges, tags, flow
# collections, documents, directives, numbers at and past the limits, bad bytes.
TOKENS = [
    b"<<: *a\n", b"&a ", b"*a", b"<<: [*a, *b]\n", b"&b {bogus: 1}\n", b"!!int ", b"!!float ",
    b"!!str ", b"!!binary ", b"!!merge ", b"!custom ", b"!<tag:yaml.org,2002:int> ", b"[", b"]",
    b"{", b"}", b"- ", b": ", b"? ", b",", b"---\n", b"...\n", b"%YAML 1.1\n",
    b"%TAG ! tag:x,2000:\n", b'"', b"'", b"|\n", b">-\n", b"#", b"\t", b"\n", b"  ", b"\r",
    b"1e999", b".nan", b"-.inf", b"0x", b"0o8", b"1_000", b"99999999999999999999", b"~",
    b"null", b"yes", b"2001-13-45", b"\\x", b'"\\u', b"\x00", b"\x1b", b"\xff", b"\xc3",
    b"\xef\xbb\xbf", "\ufffe".encode(), "\u2028".encode(), b"[" * 70, b"*",
    # Quoted numbers too big to be numbers (issue 37): what a field's own parser must bound.
    b'"inf"', b"'nan'", b'"' + b"9" * 400 + b'"', b'"' + b"9" * 400 + b'ms"', b'"1e400"',
    b"4294967296", b"-50", b"1us", b"http://u:k@h",
]
PROBLEM = re.compile(r"f\.yaml(?::\d+:\d+)?: \S.*")
LARGEST_SEED = max(SEEDS, key=len)


def _load(data: bytes) -> None:
    try:
        parse_scenario(data, "f.yaml")
    except ScenarioError as exc:
        assert exc.problems, "a ScenarioError must say what is wrong"
        for line in exc.problems:
            assert PROBLEM.fullmatch(line), line


@functools.cache
def seed_cpu_s() -> float:
    """CPU seconds the loader takes for the largest seed scenario (the least of 5, warm)."""
    _load(LARGEST_SEED)
    return min(cpu_s(lambda: _load(LARGEST_SEED))[1] for _ in range(5))


def check_loader(data: bytes) -> None:
    _, took_s = cpu_s(lambda: _load(data))
    bound_s = PER_INPUT_FACTOR * seed_cpu_s() * max(1.0, len(data) / len(LARGEST_SEED))
    assert took_s < bound_s, (took_s, bound_s)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["token", "token", "delete", "repeat", "byte", "splice"]))
        if op == "token":
            data[at:at] = draw(st.sampled_from(TOKENS))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 40))]
        elif op == "repeat":
            data[at:at] = data[at:at + draw(st.integers(1, 200))] * draw(st.integers(1, 6))
        elif op == "byte":
            data[at:at + 1] = bytes([draw(st.integers(0, 255))])
        else:
            other = draw(st.sampled_from(SEEDS))
            start = draw(st.integers(0, len(other)))
            data[at:at] = other[start:start + draw(st.integers(1, 300))]
    return bytes(data)


@pytest.mark.timeout(TIMEOUT)
@FUZZ
@given(st.binary(max_size=4096))
def test_loader_any_bytes(data: bytes) -> None:
    check_loader(data)


@pytest.mark.timeout(TIMEOUT)
@FUZZ
@given(mutated())
def test_loader_mutated_scenarios(data: bytes) -> None:
    check_loader(data)


SAFE_TEXT = st.lists(st.characters(exclude_categories=("Cc", "Cs", "Cn", "Co")) | st.sampled_from(
    ["\t", "\n", '"', "\\", ": ", "#", "&", "*", "!", "<<", "- ", "{", "[", "1e5", "~", "0x1"]),
    max_size=15).map("".join)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | SAFE_TEXT
    | st.integers(-MAX_NUMBER, MAX_NUMBER)
    | st.floats(allow_nan=False, allow_infinity=False, min_value=-1e18, max_value=1e18),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(SAFE_TEXT, inner, max_size=6),
    max_leaves=40,
)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.timeout(TIMEOUT)
@FUZZ
@given(JSON_VALUES, st.booleans())
def test_loader_reads_json_documents_as_their_values(value: Any, indent: bool) -> None:
    # JSON is YAML 1.2: what json.dumps wrote, the loader must read back exactly.
    text = json.dumps({"v": value}, ensure_ascii=False, indent=2 if indent else None)
    assert same(parse_yaml(text, "f.yaml").value, {"v": value})


# Two mappings of up to 5 nested values each (up to 40 leaves a value): hypothesis spends
# ~90 ms drawing an example (27 s for 300 on a quiet core, 45-63 s in CI's parallel tier),
# so the ci profile draws 100 of them; nightly, as many as the others.
@pytest.mark.timeout(TIMEOUT)
@settings(FUZZ, max_examples=EXAMPLES if NIGHTLY else 100)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), JSON_VALUES, max_size=5),
       st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), JSON_VALUES, max_size=5))
def test_loader_merges_and_aliases_as_yaml_says(base: dict[str, Any],
                                                 own: dict[str, Any]) -> None:
    text = (f"base: &b {json.dumps(base, ensure_ascii=False)}\n"
            f"copy: *b\n"
            f"merged: {{<<: *b, {json.dumps(own, ensure_ascii=False)[1:-1]}}}\n")
    got = parse_yaml(text, "f.yaml").value
    assert same(got["copy"], base)
    assert same(got["merged"], {**base, **own})      # explicit keys win over merged ones


# --------------------------------------------------------------------------- the SSE parser

_TERMINATOR = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


def reference(stream: bytes, limits: SSELimits | None = None) -> tuple[list[SSEEvent], bool]:
    """The WHATWG event-stream interpretation read literally, on the whole stream at once:
    (the events, whether a limit is broken). Slow and simple on purpose."""
    if stream.startswith(_BOM):
        stream = stream[3:]
    lines = _TERMINATOR.split(stream)
    partial = lines.pop()                  # an unterminated last line is never processed
    events: list[SSEEvent] = []
    data: list[bytes] = []
    event, last_id, retry = b"", b"", None
    broken = limits is not None and any(len(x) > limits.max_line_bytes for x in [*lines, partial])

    def too_big() -> bool:
        return limits is not None and (len(b"\n".join(data)) > limits.max_event_bytes
                                       or len(data) > limits.max_data_lines)

    for line in lines:
        if not line:
            if data:
                broken = broken or too_big()
                events.append(SSEEvent(event.decode("utf-8", "replace") or "message",
                                       b"\n".join(data).decode("utf-8", "replace"),
                                       last_id.decode("utf-8", "replace") or None, retry))
                data = []
            event, retry = b"", None
            continue
        if line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
        elif name == b"id" and b"\0" not in value:
            last_id = value
        elif name == b"retry" and value.isdigit():
            retry = int(value)
    return events, broken or bool(data and too_big())


def parse_in_reads(stream: bytes, cuts: list[int],
                   limits: SSELimits | None = None) -> tuple[list[SSEEvent], bool]:
    parser = SSEParser(limits)
    events: list[SSEEvent] = []
    bounds = [0, *sorted(cuts), len(stream)]
    try:
        for a, b in zip(bounds, bounds[1:], strict=False):
            events.extend(parser.feed(stream[a:b]))
    except SSELimitError:
        return events, True
    events.extend(parser.close())
    return events, False


FIELD_TEXT = st.text(st.characters(exclude_characters="\r\n", exclude_categories=("Cs",)),
                     max_size=12).map(lambda t: t.encode())
LINES = st.lists(st.one_of(
    st.builds(lambda v: b"data: " + v, FIELD_TEXT),
    st.builds(lambda v: b"data:" + v, FIELD_TEXT),
    st.just(b"data"), st.just(b""), st.just(b""),
    st.builds(lambda v: b"event: " + v, FIELD_TEXT),
    st.builds(lambda v: b"id: " + v, FIELD_TEXT),
    st.just(b"id"), st.just(b"id: 1\x002"),
    st.builds(lambda v: b"retry: " + v, st.from_regex(rb"[0-9]{1,4}x?", fullmatch=True)),
    st.builds(lambda v: b": " + v, FIELD_TEXT),
    st.builds(lambda v: b"other: " + v, FIELD_TEXT),
), max_size=30)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """Well-formed-ish event streams: the lines a server writes, each with its own line end."""
    lines = draw(LINES)
    ends = draw(st.lists(st.sampled_from([b"\n", b"\r", b"\r\n"]), min_size=len(lines),
                         max_size=len(lines)))
    body = b"".join(line + end for line, end in zip(lines, ends, strict=True))
    return (_BOM if draw(st.booleans()) else b"") + body


@st.composite
def with_cuts(draw: st.DrawFn, data: st.SearchStrategy[bytes]) -> tuple[bytes, list[int]]:
    stream = draw(data)
    cuts = draw(st.lists(st.integers(0, len(stream)), max_size=12))
    if draw(st.integers(0, 9)) == 0:
        cuts = list(range(len(stream) + 1))            # byte by byte
    return stream, cuts


@pytest.mark.timeout(TIMEOUT)
@FUZZ
@given(with_cuts(streams()))
def test_sse_every_split_of_a_stream_gives_the_same_events(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    expected, _ = reference(stream)
    assert parse_in_reads(stream, cuts) == (expected, False)
    assert parse_in_reads(stream, []) == (expected, False)


@pytest.mark.timeout(TIMEOUT)
@FUZZ
@given(with_cuts(st.binary(max_size=600) | streams().map(lambda s: s + b"\x00\xff\r")))
def test_sse_arbitrary_bytes_match_the_reference(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    expected, _ = reference(stream)
    assert parse_in_reads(stream, cuts) == (expected, False)


SMALL = SSELimits(max_line_bytes=24, max_event_bytes=40, max_data_lines=3)


@pytest.mark.timeout(TIMEOUT)
@FUZZ
@given(with_cuts(st.binary(max_size=300) | streams()))
def test_sse_limits_raise_our_error_exactly_when_broken(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    unlimited, _ = reference(stream)
    _, broken = reference(stream, SMALL)
    events, raised = parse_in_reads(stream, cuts, SMALL)
    assert raised == broken
    # What came out before the error is what a limitless reading gives, from the start.
    assert events == unlimited[:len(events)]
    if not raised:
        assert events == unlimited
