"""Recorded traffic as the source of load: request traces and prompt datasets.

A **trace** says when each request arrived and how big it was. Read here:

- Mooncake's JSONL (``{"timestamp": 3052, "input_length": 7234, "output_length": 794,
  "hash_ids": [...]}``, ``timestamp`` in milliseconds since the first request);
- Azure's LLM inference trace, as CSV (``TIMESTAMP,ContextTokens,GeneratedTokens`` with
  ``TIMESTAMP`` a date-time) or as JSONL with those keys;
- the same rows with plain names (``arrival_s`` or ``timestamp_ms``, ``input_tokens``,
  ``output_tokens``), and optionally ``class``, ``tenant`` and ``prompt`` per row.

Rows are sorted by arrival and made relative to the first (a trace recorded at 09:00 replays
from the start of the phase); ``speedup`` divides every offset (2: twice as fast).

A **prompt dataset** is JSONL (``{"prompt": "...", "max_tokens": 128}``) or CSV with a
``prompt`` column (and optionally ``max_tokens``); each request draws one (seeded).

Every problem names the file and line, and what to write instead.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from streamquake.errors import ScenarioError
from streamquake.located_yaml import read_file

MAX_TRACE_ROWS = 5_000_000
MAX_FILE_BYTES = 1 << 30
# Per row: no model's context holds more tokens (the largest are 1-2 million); a prompt built
# for 200,000,000 would be 1.5 GB of text, built before anything is sent.
MAX_ROW_TOKENS = 2_000_000
MAX_ARRIVAL_S = 366 * 86400.0      # a replay longer than a year is a wrong column or unit

_TIME_KEYS = ("arrival_s", "timestamp_ms", "timestamp", "TIMESTAMP")
_INPUT_KEYS = ("input_tokens", "input_length", "ContextTokens")
_OUTPUT_KEYS = ("output_tokens", "output_length", "GeneratedTokens")

# Words for synthesised prompts: about one token each in the common BPE vocabularies.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "was", "at", "by",
    "it", "from", "be", "this", "are", "an", "or", "have", "not", "which", "one", "all", "were",
    "when", "we", "there", "can", "more", "if", "out", "so", "some", "time", "would", "about",
    "into", "than", "them", "only", "other", "new", "these", "also", "first", "any", "may",
    "after", "most", "such", "over", "years",
)


@dataclass(frozen=True, slots=True)
class TraceRow:
    offset_s: float            # seconds after the trace's first arrival (after speedup)
    input_tokens: int
    output_tokens: int
    cls: str | None = None
    tenant: str | None = None
    prompt: str | None = None
    line: int = 0              # where it came from, for messages


@dataclass(frozen=True, slots=True)
class PromptRow:
    prompt: str
    max_tokens: int | None = None


def read_trace(path: str | Path, speedup: float = 1.0) -> list[TraceRow]:
    """Every row of the trace, sorted by arrival, offsets from the first; ScenarioError names
    the file and line of each problem (up to 10)."""
    if not speedup > 0 or math.isinf(speedup):
        raise ScenarioError(f"trace speedup {speedup!r}: must be a positive number, e.g. 2")
    p = Path(path)
    text = _read_text(p, "trace")
    raw, problems = (_csv_rows(text, p) if _looks_csv(p, text) else _jsonl_rows(text, p))
    rows: list[tuple[float, TraceRow]] = []
    for line, obj in raw:
        try:
            rows.append(_row(obj, line))
        except ValueError as exc:
            problems.append(f"{p}:{line}: {exc}")
        if len(problems) >= 10:
            break
    if problems:
        raise ScenarioError(problems)
    if not rows:
        raise ScenarioError(f"{p}: the trace has no rows; each line needs an arrival time and "
                            "token counts, e.g. {\"timestamp\": 0, \"input_length\": 512, "
                            "\"output_length\": 128}")
    rows.sort(key=lambda r: r[0])
    first = rows[0][0]
    return [TraceRow((t - first) / speedup, r.input_tokens, r.output_tokens, r.cls, r.tenant,
                     r.prompt, r.line) for t, r in rows]


def read_prompts(path: str | Path) -> list[PromptRow]:
    p = Path(path)
    text = _read_text(p, "prompt dataset")
    raw, problems = (_csv_rows(text, p) if _looks_csv(p, text) else _jsonl_rows(text, p))
    out = []
    for line, obj in raw:
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            problems.append(f"{p}:{line}: 'prompt' must be a non-empty string")
            continue
        try:
            cap = _int_field(obj, ("max_tokens",), "max_tokens", required=False)
        except ValueError as exc:
            problems.append(f"{p}:{line}: {exc}")
            continue
        out.append(PromptRow(prompt, cap))
    if problems:
        raise ScenarioError(problems[:10])
    if not out:
        raise ScenarioError(f"{p}: the prompt dataset has no rows; write one JSON object per "
                            "line, e.g. {\"prompt\": \"Summarise ...\", \"max_tokens\": 128}")
    return out


class PromptSynth:
    """Prompts of a given length, cut from one seeded text made once: slicing costs far less
    per request than drawing thousands of words (the load generator's CPU is the budget)."""

    def __init__(self, seed: str, max_tokens: int) -> None:
        words = [w for w in synth_prompt(max(1, max_tokens), random.Random(seed)).split(" ")]
        self._ends: list[int] = []
        end = -1
        for w in words:
            end += len(w) + 1
            self._ends.append(end)
        self._text = " ".join(words)

    def prompt(self, tokens: int) -> str:
        n = min(max(1, tokens), len(self._ends))
        return self._text[: self._ends[n - 1]]


def synth_prompt(tokens: int, rng: random.Random) -> str:
    """A prompt of about ``tokens`` tokens (one common English word each) for rows that carry
    none; seeded, so a replay sends the same text every time."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, tokens)))


# -- reading ----------------------------------------------------------------------------------


def _read_text(p: Path, what: str) -> str:
    """The file's text: a regular file of at most MAX_FILE_BYTES, checked for kind and size
    before it is read (a FIFO would hang the read, a link to /dev/zero never end it)."""
    if "\0" in str(p):     # no file can have that name
        raise ScenarioError(f"{ascii(str(p))}: cannot read the {what}: the path holds a NUL "
                            "character")
    data = read_file(p, what, MAX_FILE_BYTES,
                     f"give the path of a {what} file (JSON lines or CSV)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{p}: the {what} is not UTF-8 text (byte {exc.start})") from None


def _looks_csv(p: Path, text: str) -> bool:
    if p.suffix.lower() == ".csv":
        return True
    first = text.lstrip()[:1]
    return bool(first) and first not in "{["


def _jsonl_rows(text: str, p: Path) -> tuple[list[tuple[int, dict[str, object]]], list[str]]:
    rows, problems = [], []
    for n, line in enumerate(io.StringIO(text), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{p}:{n}: not JSON ({exc.msg}); write one JSON object per line")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{p}:{n}: a row must be a JSON object, not {type(obj).__name__}")
            continue
        rows.append((n, obj))
        if len(rows) > MAX_TRACE_ROWS:
            problems.append(f"{p}: more than {MAX_TRACE_ROWS} rows; replay it in parts")
            break
    return rows, problems


def _csv_rows(text: str, p: Path) -> tuple[list[tuple[int, dict[str, object]]], list[str]]:
    reader = csv.DictReader(io.StringIO(text))
    rows = []
    for obj in reader:
        rows.append((reader.line_num, {k.strip(): v for k, v in obj.items() if k}))
        if len(rows) > MAX_TRACE_ROWS:
            return rows, [f"{p}: more than {MAX_TRACE_ROWS} rows; replay it in parts"]
    return rows, []


def _row(obj: dict[str, object], line: int) -> tuple[float, TraceRow]:
    t = _arrival(obj)
    inp = _int_field(obj, _INPUT_KEYS, "input_tokens")
    out = _int_field(obj, _OUTPUT_KEYS, "output_tokens")
    assert inp is not None and out is not None
    if out < 1:
        raise ValueError(f"output tokens {out}: a streamed request asks for at least 1")
    cls, tenant, prompt = (_text(obj, name) for name in ("class", "tenant", "prompt"))
    return t, TraceRow(t, inp, out, cls, tenant, prompt, line)


def _text(obj: dict[str, object], name: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'{name}' must be a string")
    return value or None


def _arrival(obj: dict[str, object]) -> float:
    key = next((k for k in _TIME_KEYS if obj.get(k) not in (None, "")), None)
    if key is None:
        raise ValueError("no arrival time: give 'timestamp' (ms, Mooncake), 'TIMESTAMP' "
                         "(Azure), 'timestamp_ms' or 'arrival_s'")
    value = obj[key]
    if key == "TIMESTAMP" and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return _datetime_s(value)
    number = _number(value, key)
    seconds = number if key in ("arrival_s", "TIMESTAMP") else number / 1000.0
    if key != "TIMESTAMP" and seconds > MAX_ARRIVAL_S:
        raise ValueError(f"'{key}' {value!r} is more than a year after the trace's start: "
                         "give times since the first request")
    return seconds


def _datetime_s(text: str) -> float:
    # Azure writes 7 fractional digits (2023-11-16 18:15:46.6805900); Python takes up to 6.
    head, dot, frac = text.strip().partition(".")
    try:
        stamp = datetime.fromisoformat(head)
    except ValueError:
        raise ValueError(f"TIMESTAMP {text!r} is not a date-time like "
                         "2023-11-16 18:15:46.680590") from None
    fraction = float(f"0.{frac}") if dot and frac.isdigit() else 0.0
    return stamp.timestamp() + fraction


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"'{key}' must be a number, not {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"'{key}' must be a number, not {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"'{key}' must be a finite number >= 0, not {value!r}")
    return number


def _int_field(obj: dict[str, object], keys: tuple[str, ...], name: str,
               required: bool = True) -> int | None:
    key = next((k for k in keys if obj.get(k) not in (None, "")), None)
    if key is None:
        if not required:
            return None
        raise ValueError(f"no {name}: give one of {', '.join(repr(k) for k in keys)}")
    number = _number(obj[key], key)
    if number != int(number):
        raise ValueError(f"'{key}' must be a whole number of tokens, not {obj[key]!r}")
    if number > MAX_ROW_TOKENS:
        raise ValueError(f"'{key}' {obj[key]!r} is more tokens than any model's context "
                         f"({MAX_ROW_TOKENS:,}): is the column right?")
    return int(number)
