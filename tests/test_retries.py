"""Retries as the seed manual prescribes (`load.retries: standard`): which failures are retried
and after how long, and, through a real run, that every attempt is accounted for with the
retried ones counted apart, so a retry never hides a failure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from streamquake.loadgen.retry import retry_delay
from streamquake.loadgen.samples import RequestSample
from tests.conftest import run_cli
from tests.helpers import assert_run_ok


def _failed(error: str, status: int | None = None, attempt: int = 1,
            detail: str = "") -> RequestSample:
    return RequestSample(cls="c", sent=0.0, error=error, status=status,  # type: ignore[arg-type]
                         attempt=attempt, error_detail=detail)


@pytest.mark.timeout(10)
def test_which_failures_are_retried_and_when() -> None:
    assert retry_delay("none", _failed("http_status", 503)) is None
    assert retry_delay("standard", _failed("http_status", 503)) == 0.1
    assert retry_delay("standard", _failed("http_status", 503, attempt=2)) == 0.2
    assert retry_delay("standard", _failed("http_status", 503, attempt=3)) is None
    assert retry_delay("standard", _failed("connect")) == 0.1
    assert retry_delay("standard", _failed("http_status", 429)) == 0.1
    assert retry_delay("standard", _failed("http_status", 429,
                                           detail="HTTP 429 (Retry-After: 2): slow")) == 2.0
    assert retry_delay("standard", _failed("http_status", 429, attempt=2)) is None
    for never in (_failed("timeout"), _failed("truncated"), _failed("http_status", 404),
                  RequestSample(cls="c", sent=0.0)):
        assert retry_delay("standard", never) is None


SCENARIO = """
name: retries
target:
  protocol: openai
  embedded: {{ttft: 10ms, itl: 2ms, output_tokens: {{min: 3, max: 3}}, error_rate: 40%, seed: 4}}
load: {{users: 3, think_time: {{min: 20ms, max: 40ms}}, retries: {retries}}}
phases: {{warmup: 0.5s, baseline: 4s, fault: 0s, recovery: 0s}}
"""


@pytest.mark.timeout(120)
def test_retried_attempts_are_counted_apart(tmp_path: Path) -> None:
    stats = {}
    for policy in ("none", "standard"):
        scenario, out = tmp_path / f"{policy}.yaml", tmp_path / policy
        scenario.write_text(SCENARIO.format(retries=policy))
        proc = run_cli("run", str(scenario), "--out", str(out), timeout=100)
        assert_run_ok(proc, out)
        report = json.loads((out / "report.json").read_text())
        stats[policy] = next(p for p in report["phases"] if p["name"] == "baseline")["stats"]
        samples = [json.loads(line) for f in (out / "run" / "samples").glob("*.jsonl")
                   for line in f.read_text().splitlines()]
        retried = [s for s in samples if s["retried"]]
        # Shown with the other counts, in the terminal table and summary.md (retrying only).
        rows = [ln for text in (proc.stdout, (out / "summary.md").read_text())
                for ln in text.splitlines() if "retried attempts" in ln]
        if policy == "none":
            assert not retried and all(s["attempt"] == 1 for s in samples)
            assert rows == [], rows
        else:
            count = str(stats[policy]["requests_retried"])
            assert len(rows) == 2 and all(count in re.split(r"[\s|│]+", r) for r in rows), rows
            assert retried and all(s["error"] == "http_status" and s["status"] == 500
                                   for s in retried)
            assert max(s["attempt"] for s in samples) <= 3
    none, std = stats["none"], stats["standard"]
    assert none["retried_attempts"] == {} and none["requests_retried"] == 0
    assert std["retried_attempts"].get("http_status", 0) > 0 and std["requests_retried"] > 0
    # 40% of attempts fail: alone that is the error rate; with two retries, about 0.4^3.
    assert none["error_rate"] > 0.25
    assert std["error_rate"] < none["error_rate"] / 2
