"""A target whose response head never ends (issue 37, 2): endless 1 KB header lines, or one
header line without end, sent as fast as the socket takes them. The client holds a response's
head to a byte budget and to the request's timeout, however fast the bytes come: the request
ends as a counted error (``limit`` or ``timeout``) within the timeout, in bounded memory, and
``probe`` says so and exits 3.
"""

from __future__ import annotations

import random
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from streamquake.loadgen import stamps
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from tests.conftest import REPO, cli_cmd, listening

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    yield from listening([sys.executable, str(REPO / "tests" / "hostile_server.py")],
                         "hostile server")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/endless-headers", "/endless-header-line"])
def test_a_head_without_end_is_a_counted_error_within_the_timeout(hostile: str,
                                                                  path: str) -> None:
    plan = LoadPlan(base_url=hostile, protocol="sse", path=path, samples_path="/nonexistent",
                    end_at=0.0, timeout_s=TIMEOUT_S, connect_timeout_s=2.0)
    client = StreamClient(plan, environ={})
    rss_before = _rss_mib()
    try:
        start = time.perf_counter()
        sample = client.measure(RequestClassPlan(), random.Random(0))
        took = time.perf_counter() - start
    finally:
        client.close()
    print(f"\n{path}: {sample.error} after {took:.2f} s: {sample.error_detail}; "
          f"max RSS {rss_before:.0f} -> {_rss_mib():.0f} MiB")
    assert sample.error in ("limit", "timeout"), (sample.error, sample.error_detail)
    if sample.error == "limit":
        assert "response headers longer than 256 KiB" in (sample.error_detail or "")
    # Never a whole timeout past it (a hang would be; the server sends 16 MiB and stops).
    assert took < 2 * TIMEOUT_S, took
    # The head was not kept: the server's 16 MiB (and the copies an unbounded header value
    # makes as it grows) would show here.
    assert _rss_mib() - rss_before < 12, (rss_before, _rss_mib())


@pytest.mark.timeout(90)
def test_probe_ends_on_a_head_without_end(hostile: str) -> None:
    start = time.perf_counter()
    proc = subprocess.run(cli_cmd("probe", "--url", hostile, "--protocol", "sse", "--path",
                                  "/endless-header-line"),
                          capture_output=True, text=True, timeout=80, cwd=REPO)
    took = time.perf_counter() - start
    print(f"\nprobe: exit {proc.returncode} after {took:.1f} s: {proc.stdout[-300:]}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "response headers longer than" in proc.stdout + proc.stderr or \
        "no complete stream" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_head_yields_the_hub_only_once_it_has_been_read_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for a response (the server's time to answer) lets the other users run
    already: a head that came in one read never yields the hub, however long the server took;
    one still being read after ``_YIELD_S`` from its first read does (a socket that never runs
    dry must not hold the hub)."""
    yields: list[float] = []
    monkeypatch.setattr(stamps.gevent, "idle", lambda: yields.append(time.perf_counter()))
    budget = stamps._HeadBudget(time.perf_counter() + 60.0)
    time.sleep(3 * stamps._YIELD_S)         # the server answers late
    budget.took(512)
    budget.took(512)
    assert yields == []
    time.sleep(1.5 * stamps._YIELD_S)       # still reading the same head
    budget.took(512)
    assert len(yields) == 1
    budget.took(512)
    assert len(yields) == 1
    budget.took(0)                          # the peer closed: no bytes, nothing to yield for
    assert len(yields) == 1
