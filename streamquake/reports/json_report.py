"""report.json: the whole RunResult, machine-readable."""

from __future__ import annotations

import json
import math
from pathlib import Path

from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.result import RunResult


def _finite(obj: JsonValue) -> JsonValue:
    # JSON has no NaN/Infinity; a missing number is null.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):  # dataclasses.asdict keeps tuples as tuples
        return [_finite(v) for v in obj]
    return obj


def write_json(result: RunResult, path: Path) -> Path:
    data: JsonDict = {k: _finite(v) for k, v in result.to_dict().items()}
    data["schema"] = "streamquake.report/1"
    data["passed"] = not result.broken and not result.not_judged and result.interrupted is None
    path.write_text(json.dumps(data, indent=2, sort_keys=False))
    return path
