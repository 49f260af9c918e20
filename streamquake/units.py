"""Quantities as people write them in scenarios: ``100ms``, ``1.5s``, ``1m30s``, ``15%``,
``8mbit``."""

from __future__ import annotations

import math
import re
import time
import types
import typing
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, model_validator

_NUM = r"(?P<num>[0-9]+(?:\.[0-9]+)?)"
_DURATION = re.compile(rf"^\s*{_NUM}\s*(?P<unit>us|ms|s|m|h)?\s*$")
_DURATION_SCALE_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# Compound durations, Go's time.ParseDuration in spirit: "1m30s", "2h", "1h30m", "1s500ms".
# Units must come largest first and at most once each, so "30s1m" or "1m1m" are mistakes.
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(h|ms|us|m|s)")
_DURATION_ORDER = ("h", "m", "s", "ms", "us")
_DURATION_HELP = "a duration like '100ms' or '30s'"
_PERCENT = re.compile(rf"^\s*{_NUM}\s*%\s*$")
_RATE = re.compile(
    rf"^\s*{_NUM}\s*(?P<unit>bit|kbit|mbit|gbit|bps|kbps|mbps|gbps|b/s|kb/s|mb/s|gb/s)\s*$", re.I)
# tc's convention: "bit" units are bits per second, "bps" units are BYTES per second; so are
# "B/s" units ("2kB/s").
_RATE_SCALE_BYTES = {
    "bit": 1 / 8, "kbit": 1000 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9,
    "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
}
_SIZE = re.compile(rf"^\s*{_NUM}\s*(?P<unit>b|kb|k|mb|m|kib|mib)?\s*$", re.I)
_SIZE_SCALE = {"b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20}


# A finite range per unit (issue 37): a quantity past these is a mistake (a 400-digit size, a
# delay of 10^400 ms), refused where it is parsed, never left to overflow an int, turn a delay
# into NaN or a socket option into an OverflowError later.
MAX_NUMBER = 2**63 - 1          # any number in a scenario (as located_yaml holds plain ones)
DURATION_MAX_S = 366 * 86400.0  # a year: no run, step, timeout or delay is longer
SIZE_MAX = 2**31 - 1            # bytes: a socket option's int, tc's u32 fields, one read
RATE_MAX = 1e12                 # bytes/s (8 Tbit/s): past any link
REQUEST_RATE_MAX = 1e7          # requests/s: past any load generator
MAX_USERS = 1_000_000           # concurrent users: past any run's sockets
# A step, phase or time-to-recovery window shorter than this holds no request's worth of time:
# a 1 us fault step measures nothing, a 1 us window is always "not recovered".
SHORTEST_S = 0.1


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _finite(value: object, number: float | int | str) -> float:
    """``number`` as a float, or a ValueError naming ``value`` if it is not finite or is past
    MAX_NUMBER (``"inf"``, ``"nan"``, a 400-digit number: float() would overflow or give inf)."""
    try:
        x = float(number)
    except OverflowError:
        x = math.inf
    if math.isnan(x):
        raise ValueError(f"{_short(value)} is not a number: write a finite number")
    if not math.isfinite(x) or abs(x) > MAX_NUMBER:
        raise ValueError(f"the number {_short(value)} is too large: numbers in a scenario "
                         "must be finite and no larger than 2^63-1 (9.2e18)")
    return x


def _within(value: object, x: float, limit: float, shown: str) -> float:
    if x > limit:
        raise ValueError(f"must be at most {shown}, got {_short(value)}")
    return x


def _compound_s(text: str) -> float | None:
    """``"1m30s"`` -> 90.0; None unless ``text`` is two or more number+unit parts in order."""
    compact = text.replace(" ", "")
    parts = _DURATION_PART.findall(compact)
    if len(parts) < 2 or "".join(n + u for n, u in parts) != compact:
        return None
    ranks = [_DURATION_ORDER.index(u) for _, u in parts]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"expected {_DURATION_HELP}: write the units largest first, each "
                         f"once (e.g. '1h30m', '1m30s'), got {text!r}")
    return sum(_finite(text, n) * _DURATION_SCALE_S[u] for n, u in parts)


def parse_duration_s(value: object) -> float:
    """``"100ms"`` -> 0.1, ``"1m30s"`` -> 90.0. A bare number is seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected {_DURATION_HELP}, got {value!r}")
    if isinstance(value, int | float):
        x = _finite(value, value)
        if x < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return _within(value, x, DURATION_MAX_S, "a year (366d)")
    text = str(value)
    m = _DURATION.match(text)
    if m:
        x = _finite(value, m["num"]) * _DURATION_SCALE_S[m["unit"] or "s"]
        return _within(value, x, DURATION_MAX_S, "a year (366d)")
    compound = _compound_s(text.strip())
    if compound is None:
        raise ValueError(f"expected {_DURATION_HELP}, got {_short(value)}")
    return _within(value, compound, DURATION_MAX_S, "a year (366d)")


def parse_duration_ms(value: object) -> float:
    """``"1.5s"`` -> 1500.0, ``"1m30s"`` -> 90000.0. A bare number is milliseconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        x = _finite(value, value)
        if x < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return _within(value, x, DURATION_MAX_S * 1000.0, "a year (366d)")
    m = _DURATION.match(value) if isinstance(value, str) else None
    if m is not None and not m["unit"]:
        return _within(value, _finite(value, m["num"]), DURATION_MAX_S * 1000.0,
                       "a year (366d)")
    return parse_duration_s(value) * 1000.0


def format_duration(seconds: float) -> str:
    """90.0 -> ``"1m30s"``, 0.25 -> ``"250ms"``: the compound form, for people to read."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    whole = round(seconds)
    if abs(seconds - whole) >= 0.05 and seconds < 60:
        return f"{seconds:.1f}s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{n}{u}" for n, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if n) or "0s"


def not_shorter_than(minimum_s: float, what: str, *, zero_leaves_out: bool = False) -> object:
    """A validator for a duration that is 0 (where ``zero_leaves_out``) or at least
    ``minimum_s``: anything between is too short to measure, refused with one sentence."""

    def check(value: float) -> float:
        if 0 < value < minimum_s or (value == 0 and not zero_leaves_out):
            fix = f"give at least {format_duration(minimum_s)}"
            if zero_leaves_out:
                fix += " (or 0 to leave it out)"
            raise ValueError(f"{value * 1000:g}ms is too short for {what}, which must hold "
                             f"requests to measure: {fix}")
        return value

    return AfterValidator(check)


def format_clock(epoch: float) -> str:
    """An epoch time as this host's wall clock, ``14:03:27``."""
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def format_ms(ms: float) -> str:
    """350.0 -> ``"350ms"``, 10000.0 -> ``"10s"``, 90000.0 -> ``"1m30s"``, 1250.0 -> ``"1.25s"``:
    milliseconds as a scenario writes them."""
    if ms < 1000:
        return f"{ms:g}ms"
    return f"{ms / 1000:g}s" if ms % 1000 else format_duration(ms / 1000)


def format_percent(fraction: float) -> str:
    """0.01 -> ``"1%"``, 0.0005 -> ``"0.05%"``: a fraction as a scenario writes it."""
    return f"{round(fraction * 100, 6):g}%"


def format_rate(bytes_per_s: float) -> str:
    """25000.0 -> ``"200kbit"``: bytes/s in tc's bit units, as a scenario writes it."""
    bits = bytes_per_s * 8
    unit, scale = next(((u, s) for u, s in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3))
                        if bits >= s), ("bit", 1.0))
    return f"{bits / scale:.6g}{unit}"


def format_size(size_bytes: float) -> str:
    """4096 -> ``"4kb"``, 1500 -> ``"1500b"``: whole KiB/MiB where they are whole, as
    parse_size_bytes reads them back."""
    for unit, scale in (("mb", 1 << 20), ("kb", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes / scale:g}{unit}"
    return f"{size_bytes:g}b"


def parse_fraction(value: object) -> float:
    """``"15%"`` -> 0.15; a bare number in [0, 1] is taken as a fraction."""
    if isinstance(value, bool):
        raise ValueError(f"expected a percentage like '15%' or a fraction like 0.15, got {value!r}")
    if isinstance(value, int | float):
        frac = _finite(value, value)
    elif not isinstance(value, str):
        raise ValueError(f"expected a percentage like '15%' or a fraction like 0.15, got {value!r}")
    else:
        m = _PERCENT.match(value)
        if not m:
            try:
                frac = _finite(value, float(value))
            except ValueError:
                raise ValueError(
                    f"expected a percentage like '15%' or a fraction like 0.15, got {value!r}"
                ) from None
        else:
            frac = _finite(value, m["num"]) / 100.0
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"must be between 0% and 100%, got {value!r}")
    return frac


def parse_rate_bytes_per_s(value: object) -> float:
    """``"8mbit"`` -> 1_000_000.0 bytes/s (tc units: *bit = bits/s, *bps = bytes/s; and
    ``"2kB/s"`` -> 2000.0)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(f"give a unit: '8mbit' (bits/s) or '1mbps' (bytes/s), got {value!r}")
    m = _RATE.match(str(value))
    if not m:
        raise ValueError(f"expected a rate like '8mbit' or '500kbit', got {value!r}")
    x = _finite(value, m["num"]) * _RATE_SCALE_BYTES[m["unit"].lower()]
    return _within(value, x, RATE_MAX, "1e12 bytes/s (8000gbit)")


def parse_size_bytes(value: object) -> int:
    """``"32kb"`` -> 32768. A bare number is bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(_within(value, _finite(value, value), SIZE_MAX, "2^31-1 bytes (2 GiB)"))
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"expected a size like '32kb' or 1500, got {_short(value)}")
    x = _finite(value, m["num"]) * _SIZE_SCALE[(m["unit"] or "b").lower()]
    return int(_within(value, x, SIZE_MAX, "2^31-1 bytes (2 GiB)"))


def _numeric(annotation: object) -> bool:
    """Whether a field's type takes numbers and not booleans (``int``, ``float | None``,
    ``Annotated[int, ...]``)."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric(args[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_numeric(a) for a in args) and bool not in args
    return False


def bools_as_text(model: type[BaseModel], data: object) -> object:
    """A model's input with ``true``/``false`` given to a numeric field turned into text, so
    that the field itself refuses it, at its own place ("users: true" is not 1). Pydantic's
    lax mode would take it as 1 or 0; its strict mode would refuse a list for a tuple too."""
    if not isinstance(data, dict):
        return data
    out = None
    for name, field in model.model_fields.items():
        for key in {name, field.alias or name}:
            value = data.get(key)
            if isinstance(value, bool) and _numeric(field.annotation):
                out = out if out is not None else dict(data)
                out[key] = str(value).lower()
            elif isinstance(value, str) and _numeric(field.annotation):
                _number_text(key, value)
    return data if out is None else out


def _number_text(key: str, text: str) -> None:
    """A number given as text (``"inf"``, ``"nan"``, 400 quoted digits) to a numeric field:
    refused here, naming the field, as located_yaml refuses the same number unquoted."""
    try:
        x = float(text.replace("_", ""))
    except (ValueError, OverflowError):
        return              # not a number: the field's own parser says what it expected
    try:
        _finite(text, x)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


_UNSEEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})   # controls, format (U+202E), line breaks


class ScenarioModel(BaseModel):
    """The base of every model a scenario file is read into: unknown keys refused, values
    frozen, fields by name or alias, and a boolean never taken for a number
    (:func:`bools_as_text`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: object) -> object:
        return bools_as_text(cls, data)


def plain_name(value: str) -> str:
    """A name as reports print it: no control, format or line-break character (a BEL rings
    the terminal, U+202E turns the rest of a line around, a NUL ends junit.xml's text)."""
    for ch in value:
        if unicodedata.category(ch) in _UNSEEN:
            what = unicodedata.name(ch, "a control character")
            raise ValueError(f"a name cannot hold U+{ord(ch):04X} ({what}): use printable "
                             "characters")
    return value


# -- quantities as field types -----------------------------------------------------------------
# A spec declares a field's unit by its type (``delay_ms: DurationMs``); the before-validator
# turns the text a scenario writes into the number the model holds, and the ``Unit`` marker in
# the field's metadata tells the CLI's reference which text the field takes.

QuantityKind = Literal["duration", "percentage", "rate", "size"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Unit:
    """The quantities a field takes as text: ``Unit(("duration",))``."""

    kinds: tuple[QuantityKind, ...]


DURATION = Unit(("duration",))
PERCENTAGE = Unit(("percentage",))
RATE = Unit(("rate",))
SIZE = Unit(("size",))


def unit_of(annotation: object, metadata: typing.Iterable[object] = ()) -> Unit | None:
    """The ``Unit`` a field's type declares (``DurationMs``, ``Rate | None``), if any."""
    found = [m for m in metadata if isinstance(m, Unit)]
    if not found and typing.get_origin(annotation) is Annotated:
        found = [m for m in typing.get_args(annotation)[1:] if isinstance(m, Unit)]
    if not found and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [u for a in typing.get_args(annotation) if (u := unit_of(a)) is not None]
    return found[0] if found else None


def text_only(parse: Callable[[object], _T]) -> Callable[[object], _T | object]:
    """``parse`` for text; anything else goes on to the field's own type check."""
    return lambda v: parse(v) if isinstance(v, str) else v


DurationS = Annotated[float, DURATION, BeforeValidator(parse_duration_s)]
"""Seconds; a bare number is seconds."""
DurationMs = Annotated[float, DURATION, BeforeValidator(parse_duration_ms)]
"""Milliseconds; a bare number is milliseconds."""
Fraction = Annotated[float, PERCENTAGE, BeforeValidator(parse_fraction)]
"""0.15 for ``15%`` or ``0.15``."""
Rate = Annotated[float, RATE, BeforeValidator(parse_rate_bytes_per_s)]
"""Bytes/s from ``8mbit`` or ``1MB/s``; a bare number is refused (bits or bytes?)."""
RateOrBytes = Annotated[float, RATE, BeforeValidator(text_only(parse_rate_bytes_per_s)),
                        AfterValidator(lambda v: _within(v, _finite(v, v), RATE_MAX,
                                                         "1e12 bytes/s (8000gbit)"))]
"""Bytes/s from ``2kB/s``; a bare number is bytes/s."""
Size = Annotated[int, SIZE, BeforeValidator(parse_size_bytes)]
"""Bytes from ``32kb`` or a number."""
SizeOrBytes = Annotated[int, SIZE, BeforeValidator(text_only(parse_size_bytes)),
                        AfterValidator(lambda v: int(_within(v, _finite(v, v), SIZE_MAX,
                                                             "2^31-1 bytes (2 GiB)")))]
"""Bytes from ``32kb``; a number must be a whole number of bytes."""
PlainName = Annotated[str, AfterValidator(plain_name)]
"""A name as reports print it (``plain_name``)."""


def parse_request_rate(value: object) -> object:
    """Requests per second from ``10/s``, ``600/m`` or a bare number; anything else goes on to
    the field's own type check."""
    if isinstance(value, str):
        m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|m|min)\s*$", value)
        if not m:
            raise ValueError(f"expected a rate like '10/s' or '600/m', got {value!r}")
        x = _finite(value, m[1]) / (1.0 if m[2] == "s" else 60.0)
        return _within(value, x, REQUEST_RATE_MAX, "10,000,000/s")
    return value


def _request_rate_bound(value: float) -> float:
    return _within(value, _finite(value, value), REQUEST_RATE_MAX, "10,000,000/s")



RequestRate = Annotated[float, BeforeValidator(parse_request_rate),
                        AfterValidator(_request_rate_bound)]
"""Requests per second from ``10/s`` or ``600/m``; a bare number is per second."""


def quantity(model: type[BaseModel], field: str) -> str | None:
    """The text form(s) a field's type accepts ("duration", "percentage or duration"...), if
    any: read from the ``Unit`` its type carries."""
    info = model.model_fields[field]
    unit = unit_of(info.annotation, info.metadata)
    return None if unit is None else " or ".join(
        k for k in typing.get_args(QuantityKind) if k in unit.kinds)
