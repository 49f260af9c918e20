"""Numbers too big to be numbers, and data files that are not files (issue 37, 7 and 3).

Quoted huge or infinite numbers are refused where they are parsed, each unit in a finite range,
with one located sentence and exit 2, never a traceback or a run that crashes later; trace and
prompt files are checked for kind (a FIFO, a device) and size before they are read, and each
row against sane bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from streamquake.units import (
    parse_duration_ms,
    parse_duration_s,
    parse_fraction,
    parse_rate_bytes_per_s,
    parse_size_bytes,
)
from tests.conftest import REPO, cli_cmd

BIG = "1" * 400


@pytest.mark.timeout(10)
@pytest.mark.parametrize("parse, text", [
    (parse_duration_s, f"{BIG}s"), (parse_duration_s, f"{BIG}ms"),
    (parse_duration_s, f"1h{BIG}m"), (parse_duration_s, 10**400),
    (parse_duration_ms, BIG), (parse_duration_ms, 10**400), (parse_duration_ms, "8785h"),
    (parse_size_bytes, BIG), (parse_size_bytes, f"{BIG}kb"), (parse_size_bytes, 4294967296),
    (parse_rate_bytes_per_s, f"{BIG}mbit"), (parse_fraction, "nan"), (parse_fraction, 10**400),
])
def test_every_unit_has_a_finite_range(parse: object, text: object) -> None:
    assert callable(parse)
    with pytest.raises(ValueError) as info:
        value = parse(text)
        print(f"{text!r:.50} -> {value!r}")
    assert len(str(info.value)) < 200          # the 400 digits are not echoed whole
    assert parse_duration_s("8760h") == 8760 * 3600.0      # a year is in range


def _scenario(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text("name: t\n" + body)
    return path


def _validate(path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_cmd("validate", str(path)), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


TARGET = "target: {protocol: openai, embedded: {}}\n"
PHASES = "phases: {baseline: 1s, fault: 1s, recovery: 1s}\n"
CASES = {
    "receive_buffer": TARGET + PHASES + "load: {classes: [{name: c, read: "
                      "{receive_buffer: 4294967296}}]}\n",
    "quoted size": TARGET + PHASES + f"load: {{classes: [{{name: c, read: "
                   f"{{receive_buffer: '{BIG}'}}}}]}}\n",
    "timeout": f"target: {{protocol: openai, embedded: {{}}, timeout: '{BIG}'}}\n" + PHASES,
    "step duration": TARGET + f"steps: [{{name: s, duration: '{BIG}s'}}]\n",
    "users": TARGET + PHASES + f"load: {{users: '{BIG}'}}\n",
    "users 2^63": TARGET + PHASES + "load: {users: 9223372036854775807}\n",
    "weight inf": TARGET + PHASES + "load: {classes: [{name: c, weight: 'inf'}]}\n",
    "weight nan": TARGET + PHASES + "load: {classes: [{name: c, weight: 'nan'}]}\n",
    "power inf": TARGET + PHASES + "faults: [{type: gpu_clocks, power_limit_w: 'inf'}]\n",
    "power 1e308": TARGET + PHASES + "faults: [{type: gpu_clocks, power_limit_w: 1e308}]\n",
    "jitter": TARGET + PHASES + f"faults: [{{type: sse_proxy, delay: 1ms, "
              f"delay_jitter: '{BIG}'}}]\n",
    "jitter 1e400": TARGET + PHASES + "faults: [{type: sse_proxy, delay: 1ms, "
                    "delay_jitter: '1e400'}]\n",
    "retry_after": TARGET + PHASES + f"faults: [{{type: sse_proxy, abort: {{status: 503, "
                   f"retry_after: '{BIG}'}}}}]\n",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_a_quoted_huge_or_infinite_number_is_one_located_sentence(tmp_path: Path,
                                                                   case: str) -> None:
    proc = _validate(_scenario(tmp_path, CASES[case]))
    out = proc.stdout + proc.stderr
    print(f"\n{case}: exit {proc.returncode}: {out.strip()[:300]}")
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "s.yaml:" in out                  # located: file:line:col
    assert BIG not in out                    # the 400 digits are not echoed whole


ROW = {"timestamp": 0, "input_length": 16, "output_length": 8}


def _trace_scenario(tmp_path: Path, trace: Path) -> Path:
    return _scenario(tmp_path, TARGET + PHASES +
                     f"load: {{users: 2, trace: {{file: '{trace}'}}}}\n")


@pytest.mark.timeout(60)
def test_a_trace_that_is_a_fifo_is_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    proc = _validate(_trace_scenario(tmp_path, fifo), timeout=40)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "is a FIFO (named pipe), not a trace" in out, out
    dry = subprocess.run(cli_cmd("run", str(tmp_path / "s.yaml"), "--dry-run"),
                         capture_output=True, text=True, timeout=40, cwd=REPO)
    assert dry.returncode == 2, dry.stdout + dry.stderr


@pytest.mark.timeout(60)
def test_a_trace_linked_to_a_device_is_refused_not_read(tmp_path: Path) -> None:
    link = tmp_path / "trace.jsonl"
    link.symlink_to("/dev/zero")
    proc = _validate(_trace_scenario(tmp_path, link), timeout=40)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "is a character device, not a trace" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("row, says", [
    ({**ROW, "input_length": 200_000_000}, "more tokens than any model's context"),
    ({**ROW, "output_length": 10**12}, "more tokens than any model's context"),
    ({"TIMESTAMP": "nan", "ContextTokens": 5, "GeneratedTokens": 5}, "finite number"),
    ({"TIMESTAMP": "inf", "ContextTokens": 5, "GeneratedTokens": 5}, "finite number"),
    ({**ROW, "timestamp": 1e15}, "more than a year after"),
])
def test_a_trace_row_out_of_bounds_is_refused(tmp_path: Path, row: dict[str, object],
                                              says: str) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(ROW) + "\n" + json.dumps(row) + "\n")
    proc = _validate(_trace_scenario(tmp_path, trace))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert says in out and "trace.jsonl:2" in out, out
