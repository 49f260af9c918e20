"""Quantities as people write them in scenarios: ``100ms``, ``1.5s``, ``15%``, ``8mbit``."""

from __future__ import annotations

import re

_NUM = r"(?P<num>[0-9]+(?:\.[0-9]+)?)"
_DURATION = re.compile(rf"^\s*{_NUM}\s*(?P<unit>us|ms|s|m|h)?\s*$")
_DURATION_SCALE_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PERCENT = re.compile(rf"^\s*{_NUM}\s*%\s*$")
_RATE = re.compile(rf"^\s*{_NUM}\s*(?P<unit>bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)\s*$", re.I)
# tc's convention: "bit" units are bits per second, "bps" units are BYTES per second.
_RATE_SCALE_BYTES = {
    "bit": 1 / 8, "kbit": 1000 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9,
}
_SIZE = re.compile(rf"^\s*{_NUM}\s*(?P<unit>b|kb|k|mb|m|kib|mib)?\s*$", re.I)
_SIZE_SCALE = {"b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20}


def parse_duration_s(value: str | int | float) -> float:
    """``"100ms"`` -> 0.1. A bare number is seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '100ms' or '30s', got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return float(value)
    m = _DURATION.match(str(value))
    if not m:
        raise ValueError(f"expected a duration like '100ms' or '30s', got {value!r}")
    return float(m["num"]) * _DURATION_SCALE_S[m["unit"] or "s"]


def parse_duration_ms(value: str | int | float) -> float:
    """``"1.5s"`` -> 1500.0. A bare number is milliseconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a duration cannot be negative, got {value!r}")
        return float(value)
    m = _DURATION.match(value) if isinstance(value, str) else None
    if m is not None and not m["unit"]:
        return float(m["num"])
    return parse_duration_s(value) * 1000.0


def parse_fraction(value: str | int | float) -> float:
    """``"15%"`` -> 0.15; a bare number in [0, 1] is taken as a fraction."""
    if isinstance(value, bool):
        raise ValueError(f"expected a percentage like '15%' or a fraction like 0.15, got {value!r}")
    if isinstance(value, int | float):
        frac = float(value)
    else:
        m = _PERCENT.match(value)
        if not m:
            try:
                frac = float(value)
            except ValueError:
                raise ValueError(
                    f"expected a percentage like '15%' or a fraction like 0.15, got {value!r}"
                ) from None
        else:
            frac = float(m["num"]) / 100.0
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"must be between 0% and 100%, got {value!r}")
    return frac


def parse_rate_bytes_per_s(value: str | int | float) -> float:
    """``"8mbit"`` -> 1_000_000.0 bytes/s (tc units: *bit = bits/s, *bps = bytes/s)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError(f"give a unit: '8mbit' (bits/s) or '1mbps' (bytes/s), got {value!r}")
    m = _RATE.match(str(value))
    if not m:
        raise ValueError(f"expected a rate like '8mbit' or '500kbit', got {value!r}")
    return float(m["num"]) * _RATE_SCALE_BYTES[m["unit"].lower()]


def parse_size_bytes(value: str | int) -> int:
    """``"32kb"`` -> 32768. A bare number is bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"expected a size like '32kb' or 1500, got {value!r}")
    return int(float(m["num"]) * _SIZE_SCALE[(m["unit"] or "b").lower()])
