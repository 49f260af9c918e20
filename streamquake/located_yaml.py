"""YAML in, a validated pydantic model out, with positions: every problem in a file at once,
as ``file:line:col: field.path: message (hint)``. The scenario loader
(``scenario/loader.py``), ``--set`` overrides, data files and the embedded target's settings all
read YAML through here.

Any bytes give either a plan or a ScenarioError, never a traceback, in bounded time and
memory: the file is refused unless it is a regular file of at most MAX_FILE_BYTES, must be
UTF-8 without control characters, and is built from the parser's event stream (never
ruamel's recursive composer or constructor) with limits on nesting depth (MAX_DEPTH),
values after alias expansion (MAX_VALUES) and number magnitude (MAX_NUMBER).
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import re
import stat
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    DocumentStartEvent,
    Event,
    MappingStartEvent,
    ScalarEvent,
    SequenceStartEvent,
)

from streamquake.errors import ScenarioError, validation_message
from streamquake.jsontypes import JsonValue

M = TypeVar("M", bound=BaseModel)

# A shipped scenario is 1-3 KB; a thousand long prompts still fit in 1 MiB. The pure-Python
# YAML scanner reads about 0.5-2 MB/s on the worst inputs, so this also bounds the time.
MAX_FILE_BYTES = 1 << 20
# A scenario is about 6 levels deep; a request class's own ``body`` (JSON with tool schemas)
# rarely passes 20.
MAX_DEPTH = 64
# Scalars and collections, counting an alias as everything it stands for: bounds what the
# schema walks (an "alias bomb" of 9 aliases to 9 aliases... expands to billions).
MAX_VALUES = 50_000
# Numbers are seeds, counts, durations and rates: 2^63 - 1 is the largest any of them means.
MAX_NUMBER = 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
# Problems printed at most; the rest are counted.
MAX_PROBLEMS = 50

def load_model(path: str | Path, model: type[M], what: str, shape: str) -> M:
    """Any YAML/JSON file validated as ``model`` (e.g. the embedded target's settings), with
    the same limits and ``file:line:col`` errors as a scenario. An empty file is ``{}``."""
    p = Path(path)
    doc = parse_yaml(read_file(p, what), str(p))
    if doc.value is None:
        doc = YamlDoc({}, doc.pos)
    return validate(model, doc, str(p), shape)


# --------------------------------------------------------------------------- the file


def read_file(path: Path, what: str, limit: int = MAX_FILE_BYTES,
              hint: str = "give the path of a YAML file") -> bytes:
    """The file's bytes, refusing anything that is not a regular file of at most ``limit``
    bytes before opening it for reading (a FIFO would block the open, or the read, forever;
    a device would never end). ``hint`` says what to give instead of a FIFO or device."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: cannot read the {what}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"{path}: cannot read the {what}: {_os_reason(exc)}") from None
    _check_regular(path, st, what, limit, hint)
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO since the stat, opening cannot hang.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the {what}: {_os_reason(exc)}") from None
    try:
        _check_regular(path, os.fstat(fd), what, limit, hint)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the {what}: {_os_reason(exc)}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ScenarioError(_too_big(path, what, size, limit))
    return b"".join(chunks)


def _check_regular(path: Path, st: os.stat_result, what: str, limit: int = MAX_FILE_BYTES,
                   hint: str = "give the path of a YAML file") -> None:
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise ScenarioError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else
                "a character device" if stat.S_ISCHR(mode) else
                "a block device" if stat.S_ISBLK(mode) else "not a regular file")
        raise ScenarioError(f"{path}: is {kind}, not a {what}: {hint}")
    if st.st_size > limit:
        raise ScenarioError(_too_big(path, what, st.st_size, limit))


def _too_big(path: Path, what: str, size: int, limit: int = MAX_FILE_BYTES) -> str:
    shown = f"{size:,} bytes" if size <= limit * 4 else f"more than {_mib(limit * 4)}"
    return (f"{path}: the {what} is {shown}; the limit is {_mib(limit)} ({limit:,} bytes): "
            "is this the right file?")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------- text

# What YAML 1.2 allows in a stream (ruamel's Reader.NON_PRINTABLE is the complement of this).
_BAD_CHAR = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")
_CHAR_NAMES = {0: "NUL", 7: "BEL", 8: "BS", 0x0B: "VT", 0x0C: "FF", 0x1B: "ESC", 0x7F: "DEL",
               0xFFFE: "a non-character", 0xFFFF: "a non-character"}


def decode(data: bytes, filename: str) -> str:
    """UTF-8 (a leading BOM dropped) or a located error naming the first bad byte."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ScenarioError(f"{filename}: the file is UTF-16 or UTF-32 (it starts with a byte "
                            "order mark): save it as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        prefix = data[:exc.start].decode("utf-8")
        line, col = _line_col(prefix, len(prefix))
        byte = data[exc.start]
        raise ScenarioError(f"{filename}:{line}:{col}: not UTF-8: byte 0x{byte:02x} is an "
                            f"{exc.reason}: save the file as UTF-8") from None
    return text[1:] if text.startswith("\ufeff") else text


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of ``text[index]``, counting line breaks as YAML does."""
    line, start = 1, 0
    for m in _BREAK.finditer(text, 0, index):
        if m.end() > index:
            break
        line, start = line + 1, m.end()
    return line, index - start + 1


def _control_characters(text: str, filename: str) -> list[str]:
    problems: list[str] = []
    for m in _BAD_CHAR.finditer(text):
        if len(problems) == 5:
            problems.append(f"{filename}: (more control characters follow)")
            break
        code = ord(m.group())
        name = _CHAR_NAMES.get(code)
        what = f"U+{code:04X}" + (f" ({name})" if name else "")
        line, col = _line_col(text, m.start())
        hint = ("remove it" if code >= 0xD800 else
                f'remove it, or write it as "\\x{code:02x}" inside double quotes')
        problems.append(f"{filename}:{line}:{col}: the control character {what} is not allowed "
                        f"in YAML ({hint})")
    return problems


# --------------------------------------------------------------------------- YAML events


@dataclass(slots=True)
class Pos:
    """Where a value is in the file (1-based), and where its keys or items are."""

    line: int
    col: int
    keys: dict[str, tuple[int, int, Pos]] | None = None    # key -> (key line, key col, value)
    items: list[Pos] | None = None
    source: str | None = None       # not from the file: the ``--set`` that put it here


@dataclass(slots=True)
class YamlDoc:
    """A document as plain Python values (dict, list, str, int, float, bool, None)."""

    value: JsonValue
    pos: Pos


class _Abort(Exception):
    """A hard limit was reached: stop reading at once."""


class _Key(enum.Enum):
    MERGE = enum.auto()     # the pending key is "<<"
    SKIP = enum.auto()      # the pending key was refused: drop its value


class _Broken(enum.Enum):
    BROKEN = enum.auto()    # an alias already reported as undefined: no further complaints


@dataclass(slots=True)
class _Open:
    """A mapping or sequence being built."""

    value: dict[str, JsonValue] | list[JsonValue]
    pos: Pos
    anchor: str | None
    count_at_start: int
    height: int = 1                     # levels of collections in it, itself included
    key: str | _Key | None = None       # mapping: the key waiting for its value (None: none)
    key_at: tuple[int, int] = (1, 1)
    merges: list[tuple[dict[str, JsonValue], Pos]] = field(default_factory=list)


@dataclass(slots=True)
class _Anchored:
    value: JsonValue
    pos: Pos
    size: int                           # values it stands for
    height: int                         # 0 for a scalar
    text: str | None                    # a scalar's source text (for use as a key)


_CORE = "tag:yaml.org,2002:"
_NULL = re.compile(r"~|null|Null|NULL|")
_BOOL = {"true": True, "True": True, "TRUE": True,
         "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?(?:[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)")
_FLOAT = re.compile(r"[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")


class _Builder:
    """Turns the parser's events into plain values plus their positions, enforcing limits."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[str] = []
        self.count = 0
        self.stack: list[_Open] = []
        self.anchors: dict[str, _Anchored] = {}
        self.open_anchors: set[str] = set()
        self.documents = 0
        self.root: YamlDoc | None = None

    def at(self, line: int, col: int, message: str) -> str:
        return f"{self.filename}:{line}:{col}: {message}"

    def problem(self, line: int, col: int, message: str) -> None:
        self.problems.append(self.at(line, col, message))

    def abort(self, line: int, col: int, message: str) -> typing.NoReturn:
        self.problem(line, col, message)
        raise _Abort

    # Events --------------------------------------------------------------------------

    def event(self, ev: Event) -> None:
        if isinstance(ev, ScalarEvent):
            self.scalar(ev)
        elif isinstance(ev, MappingStartEvent | SequenceStartEvent):
            self.start(ev)
        elif isinstance(ev, CollectionEndEvent):
            self.end()
        elif isinstance(ev, AliasEvent):
            self.alias(ev)
        elif isinstance(ev, DocumentStartEvent):
            self.documents += 1
            if self.documents > 1:
                line, col = _mark(ev)
                self.abort(line, col, "a second YAML document starts here; a scenario file "
                                      "holds one (remove the '---' line)")

    def scalar(self, ev: ScalarEvent) -> None:
        line, col = _mark(ev)
        self.counted(line, col, 1)
        text = str(ev.value)
        if half := _SURROGATE.search(text):
            # Written as a "\ud800" escape: no file, header or JSON body can carry it.
            self.problem(line, col, f"the text holds U+{ord(half.group()):04X}, half of a "
                                    "surrogate pair, which is not a character: write the "
                                    "character itself")
            text = _SURROGATE.sub("\ufffd", text)
        tag = None if ev.tag is None else str(ev.tag)
        plain = tag is None and bool(ev.implicit and ev.implicit[0]) and ev.style is None
        value = self.construct(text, tag, plain, line, col)
        pos = Pos(line, col)
        is_merge = text == "<<" and (plain or tag == _CORE + "merge")
        if ev.anchor is not None:
            self.anchors[str(ev.anchor)] = _Anchored(value, pos, 1, 0, text)
        self.add(value, pos, 0, text, is_merge)

    def start(self, ev: MappingStartEvent | SequenceStartEvent) -> None:
        line, col = _mark(ev)
        self.counted(line, col, 1)
        if len(self.stack) + 1 > MAX_DEPTH:
            self.abort(line, col, f"nested more than {MAX_DEPTH} levels deep (the limit; a "
                                  "scenario needs about 6)")
        is_map = isinstance(ev, MappingStartEvent)
        tag = None if ev.tag is None else str(ev.tag)
        if tag not in (None, "!", _CORE + ("map" if is_map else "seq")):
            self.problem(line, col, f"the tag {_tag(tag)} is not supported in a scenario "
                                    "(remove it)")
        pos = Pos(line, col, keys={} if is_map else None, items=None if is_map else [])
        anchor = None if ev.anchor is None else str(ev.anchor)
        if anchor is not None:
            self.open_anchors.add(anchor)
        value: dict[str, JsonValue] | list[JsonValue] = {} if is_map else []
        self.stack.append(_Open(value, pos, anchor, self.count))

    def end(self) -> None:
        top = self.stack.pop()
        if isinstance(top.value, dict):
            for merged, mpos in top.merges:
                keys = mpos.keys or {}
                for k, v in merged.items():
                    if k not in top.value:       # explicit keys win; earlier merges win
                        top.value[k] = v
                        if top.pos.keys is not None and k in keys:
                            top.pos.keys[k] = keys[k]
        if top.anchor is not None:
            self.open_anchors.discard(top.anchor)
            self.anchors[top.anchor] = _Anchored(
                top.value, top.pos, self.count - top.count_at_start + 1, top.height, None)
        self.add(top.value, top.pos, top.height, None, False)

    def alias(self, ev: AliasEvent) -> None:
        line, col = _mark(ev)
        name = str(ev.anchor)
        target = self.anchors.get(name)
        if target is None:
            message = (f"the alias '*{name}' is used inside the value it names (a recursive "
                       "structure)" if name in self.open_anchors else
                       f"the alias '*{name}' names no anchor '&{name}' defined before it")
            self.problem(line, col, message)
            self.counted(line, col, 1)
            self.add(_Broken.BROKEN, Pos(line, col), 0, None, False)
            return
        if self.count + target.size > MAX_VALUES:
            self.abort(line, col, f"the alias '*{name}' stands for {target.size:,} values, "
                                  f"which makes more than {MAX_VALUES:,} in all (aliases "
                                  "multiply: is this an alias bomb?)")
        self.count += target.size
        if len(self.stack) + target.height > MAX_DEPTH:
            self.abort(line, col, f"the alias '*{name}' nests values more than {MAX_DEPTH} "
                                  "levels deep")
        self.add(target.value, target.pos, target.height, target.text, False)

    def counted(self, line: int, col: int, n: int) -> None:
        self.count += n
        if self.count > MAX_VALUES:
            self.abort(line, col, f"more than {MAX_VALUES:,} values; a scenario needs far "
                                  "fewer: is this the right file?")

    # Building ------------------------------------------------------------------------

    def add(self, value: JsonValue | _Broken, pos: Pos, height: int, text: str | None,
            is_merge: bool) -> None:
        if not self.stack:
            self.root = YamlDoc(None if value is _Broken.BROKEN else value, pos)
            return
        top = self.stack[-1]
        top.height = max(top.height, height + 1)
        if value is _Broken.BROKEN:
            if isinstance(top.value, dict):
                top.key = _Key.SKIP if top.key is None else None
                return
            value = None
        if isinstance(top.value, list):
            top.value.append(value)
            if top.pos.items is not None:
                top.pos.items.append(pos)
            return
        if top.key is None:
            self.key(top, value, pos, height, text, is_merge)
            return
        key, top.key = top.key, None
        if key is _Key.SKIP:
            return
        if key is _Key.MERGE:
            self.merge(top, value, pos)
            return
        top.value[key] = value
        if top.pos.keys is not None:
            top.pos.keys[key] = (*top.key_at, pos)

    def key(self, top: _Open, value: JsonValue, pos: Pos, height: int, text: str | None,
            is_merge: bool) -> None:
        assert isinstance(top.value, dict)
        if height > 0 or text is None:
            self.problem(pos.line, pos.col, "a key must be plain text, not a list or a mapping")
            top.key = _Key.SKIP
        elif is_merge:
            top.key = _Key.MERGE
        elif text in top.value and top.pos.keys is not None and text in top.pos.keys:
            first = top.pos.keys[text][0]
            self.problem(pos.line, pos.col, f"duplicate key '{_short(text)}' (first given on "
                                            f"line {first}): give each key once")
            top.key = _Key.SKIP
        else:
            top.key = text
            top.key_at = (pos.line, pos.col)

    def merge(self, top: _Open, value: JsonValue, pos: Pos) -> None:
        if isinstance(value, dict):
            top.merges.append((value, pos))
            return
        if isinstance(value, list) and pos.items is not None:
            maps = [v for v in value if isinstance(v, dict)]
            if len(maps) == len(value):
                top.merges.extend(zip(maps, pos.items, strict=True))
                return
        self.problem(pos.line, pos.col, f"'<<' merges a mapping (or a list of mappings) into "
                                        f"this one, but this is {_kind(value)}")

    def construct(self, text: str, tag: str | None, plain: bool, line: int, col: int) -> JsonValue:
        if tag is None:
            return _resolve(text, self, line, col) if plain else text
        if tag in ("!", _CORE + "str"):
            return text
        if tag == _CORE + "int":
            if _INT.fullmatch(text):
                return self.number(_to_int, text, line, col)
        elif tag == _CORE + "float":
            if _FLOAT.fullmatch(text) or _INT.fullmatch(text):
                return self.number(_to_float, text, line, col)
        elif tag == _CORE + "bool":
            if text in _BOOL:
                return _BOOL[text]
        elif tag == _CORE + "null":
            if _NULL.fullmatch(text):
                return None
        else:
            self.problem(line, col, f"the tag {_tag(tag)} is not supported in a scenario "
                                    "(remove it)")
            return None
        self.problem(line, col, f"'{_short(text)}' is not a valid {tag.removeprefix(_CORE)} "
                                f"(it is tagged {_tag(tag)})")
        return None

    def number(self, convert: typing.Callable[[str], int | float], text: str, line: int,
               col: int, implicit: bool = False) -> JsonValue:
        try:
            value = convert(text)
        except OverflowError:
            value = math.inf
        except ValueError:
            if implicit:            # looked like a number ("0x_"), but is text
                return text
            self.problem(line, col, f"'{_short(text)}' is not a valid number")
            return None
        if isinstance(value, float) and math.isnan(value):
            self.problem(line, col, f"'{_short(text)}' is not a number: write a finite number")
            return None
        if abs(value) > MAX_NUMBER:
            what = "infinite" if value in (math.inf, -math.inf) and "inf" in text.lower() \
                else "too large"
            self.problem(line, col, f"the number '{_short(text)}' is {what}: numbers in a "
                                    "scenario must be finite and no larger than 2^63-1 (9.2e18)")
            return None
        return value


def _resolve(text: str, builder: _Builder, line: int, col: int) -> JsonValue:
    """A plain scalar by the YAML 1.2 core schema (underscores allowed in numbers, as ruamel
    allows them); anything else (dates included) stays text."""
    if not text or text[0] in "~nN":
        if _NULL.fullmatch(text):
            return None
    elif text in _BOOL:
        return _BOOL[text]
    elif text[0] in "-+.0123456789":
        if _INT.fullmatch(text) and any(c.isdigit() for c in text):
            return builder.number(_to_int, text, line, col, implicit=True)
        if _FLOAT.fullmatch(text) and (any(c.isdigit() for c in text) or "n" in text.lower()):
            return builder.number(_to_float, text, line, col, implicit=True)
    return text


def _to_int(text: str) -> int:
    s = text.replace("_", "")
    sign = -1 if s.startswith("-") else 1
    s = s.lstrip("+-")
    if len(s) > 70:                 # past 2^63 in any base; never let int() see 4,300 digits
        raise OverflowError
    base = {"0o": 8, "0x": 16, "0b": 2}.get(s[:2], 10)
    return sign * int(s[2:] if base != 10 else s, base)


def _to_float(text: str) -> float:
    s = text.replace("_", "")
    low = s.lower().lstrip("+-")
    if low in (".inf", ".nan"):
        return float(s.replace(".", "", 1))
    if _INT.fullmatch(s) and not s.lstrip("+-").isdigit():
        return float(_to_int(s))
    if len(s) > 400:
        raise OverflowError
    return float(s)


def _mark(ev: Event) -> tuple[int, int]:
    mark = ev.start_mark
    return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _tag(tag: str) -> str:
    return _short("!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag)


def _kind(value: JsonValue) -> str:
    if isinstance(value, list):
        return "a list of other things"
    if value is None:
        return "empty"
    return f"the {type(value).__name__} {_short(str(value))!r}"


def parse_yaml(text: str | bytes, filename: str) -> YamlDoc:
    """One YAML document as plain values and positions, or a ScenarioError."""
    if isinstance(text, bytes):
        text = decode(text, filename)
    if len(text) > MAX_FILE_BYTES:
        raise ScenarioError(f"{filename}: more than {MAX_FILE_BYTES:,} characters; the limit "
                            "is 1 MiB: is this the right file?")
    bad = _control_characters(text, filename)
    if bad:
        raise ScenarioError(bad)
    builder = _Builder(filename)
    try:
        for ev in YAML(typ="safe", pure=True).parse(text):
            builder.event(ev)
    except _Abort:
        raise ScenarioError(_capped(builder.problems, filename)) from None
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        problem = exc.problem or exc.context or "unreadable"
        raise ScenarioError([*builder.problems, f"{where}: not valid YAML: {problem}"]) from None
    except YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ScenarioError([*builder.problems, f"{filename}: not valid YAML: {first}"]) from None
    if builder.problems:
        raise ScenarioError(_capped(builder.problems, filename))
    return builder.root or YamlDoc(None, Pos(1, 1))


def _capped(problems: list[str], filename: str) -> list[str]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    more = len(problems) - MAX_PROBLEMS
    return [*problems[:MAX_PROBLEMS], f"{filename}: ... and {more:,} more problems like these"]


# --------------------------------------------------------------------------- validation


def validate(model: type[M], doc: YamlDoc, filename: str, shape: str) -> M:
    if not isinstance(doc.value, dict):
        raise ScenarioError(f"{filename}:1:1: {shape}")
    try:
        return model.model_validate(doc.value)
    except ValidationError as exc:
        problems = _format_errors(exc, doc.pos, filename, model)
        raise ScenarioError(_capped(problems, filename)) from None
    except RecursionError:
        raise ScenarioError(f"{filename}: nested too deeply to check") from None


def _locate(pos: Pos, loc: tuple[int | str, ...]) -> tuple[int, int, list[str], str | None]:
    """Walk the positions along a pydantic error location: (line, col, yaml path found, the
    ``--set`` it came from if it did not come from the file)."""
    node, line, col, path = pos, 1, 1, []
    for part in loc:
        if node.keys is not None and isinstance(part, str) and part in node.keys:
            line, col, node = node.keys[part]
            path.append(part)
        elif node.items is not None and isinstance(part, int) and 0 <= part < len(node.items):
            node = node.items[part]
            line, col = node.line, node.col
            path.append(str(part))
        # Anything else is a union tag or validator name that has no place in the YAML.
    return line, col, path, node.source


def _format_errors(exc: ValidationError, pos: Pos, filename: str,
                   model: type[BaseModel]) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        msg = validation_message(err)
        if (named := _named_place(msg, model)) is not None:
            # A check across fields that names where it found the problem ("slos.0.phases.1:
            # ..."): located there, not at the top of the file.
            extra, msg = named
            loc = (*loc, *extra)
        line, col, path, source = _locate(pos, loc)
        field_path = ".".join(path) or "(top level)"
        kind = err["type"]
        if kind == "missing":
            missing = str(loc[-1])
            field_path = ".".join([*path, missing])
            msg = "required field is missing"
            hint = f"add '{missing}:' here"
        elif kind == "extra_forbidden":
            msg = "unknown field"
            hint = _spelling_hint(model, loc)
        elif kind == "union_tag_invalid":
            ctx = err.get("ctx") or {}
            tag, key = str(ctx.get("tag", "")), str(ctx.get("discriminator", "type")).strip("'")
            expected = [t.strip(" '") for t in str(ctx.get("expected_tags", "")).split(",")]
            close = difflib.get_close_matches(tag, expected, n=1)
            line, col, path, source = _locate(pos, (*loc, key))
            field_path = ".".join(path)
            msg = f"'{tag}' is not a {key} known here"
            hint = (f"did you mean '{close[0]}'? " if close else "") + \
                f"one of: {', '.join(expected)}"
        else:
            hint = _HINTS.get(kind, "")
            if kind in ("float_parsing", "int_parsing") and isinstance(err.get("input"), str) \
                    and (digits := re.search(r"\d+(\.\d+)?", err["input"])) and path:
                hint += f", e.g. {path[-1]}: {digits.group(0)}"
        suffix = f" (hint: {hint})" if hint else ""
        where = f"{filename} ({source})" if source else f"{filename}:{line}:{col}"
        problems.append(f"{where}: {field_path}: {msg}{suffix}")
    return problems


def _named_place(msg: str, model: type[BaseModel]) -> tuple[tuple[int | str, ...], str] | None:
    """``("slos", 0, "phases", 1), "rest"`` from ``"slos.0.phases.1: rest"`` when the dotted
    path starts at one of ``model``'s fields; else None."""
    m = re.match(r"([A-Za-z_]\w*(?:\.\w+)*): (.+)", msg, re.S)
    if m is None or m.group(1).split(".")[0] not in _field_names(model):
        return None
    return tuple(int(p) if p.isdigit() else p for p in m.group(1).split(".")), m.group(2)


def _spelling_hint(root: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    model = _model_at(root, loc[:-1])
    if model is None:
        return "remove it"
    allowed = sorted(_field_names(model))
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f"did you mean '{close[0]}'? allowed here: {', '.join(allowed)}"
    return f"remove it; allowed here: {', '.join(allowed)}"


def _field_names(model: type[BaseModel]) -> dict[str, str]:
    """YAML key -> python attribute name."""
    return {(f.alias or name): name for name, f in model.model_fields.items()}


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class an error location points into (union tags and list indexes skipped)."""
    current: object = model
    for part in loc:
        candidates = _models_in(current)
        tagged = [m for m in candidates if _tag_of(m) == part]
        if tagged:
            current = tagged[0]
            continue
        owners = [m for m in candidates if part in _field_names(m)]
        if owners:
            current = owners[0].model_fields[_field_names(owners[0])[str(part)]].annotation
    found = _models_in(current)
    return found[0] if found else None


def _models_in(tp: object) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in typing.get_args(tp) for m in _models_in(arg)]


def _tag_of(model: type[BaseModel]) -> str | None:
    for key in ("type", "dist", "mode"):
        f = model.model_fields.get(key)
        if f is not None:
            args = typing.get_args(f.annotation)
            if len(args) == 1:
                return str(args[0])
    return None


_HINTS = {
    "literal_error": "use one of the values listed",
    "union_tag_invalid": "use one of the values listed",
    "union_tag_not_found": "add 'type:' naming the kind of fault",
    "int_parsing": "write a whole number",
    "int_from_float": "write a whole number",
    "float_parsing": "write a number",
    "bool_parsing": "write true or false",
    "greater_than": "use a bigger value",
    "greater_than_equal": "use a bigger value",
    "less_than_equal": "use a smaller value",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list (lines starting with '- ')",
    "model_type": "write a mapping (key: value lines)",
}
