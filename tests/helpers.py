"""What a test may assert about a whole run's exit code, on a machine that may be busy.

A run whose load generator was saturated in a step has that step's timings marked distorted:
its gating timing checks are not judged, and a run where nothing broke then ends with 6
(``errors.EXIT_NOT_JUDGED``) instead of 0 (README "Commands and exit codes"). A test about
formats, counts or files written must not depend on that: ``assert_run_ok`` takes 0 or 6. A
test about a verdict uses ``assert_verdict``: the code it expects, or 6 where the report says
the checks that would have decided it were not judged.

And what several tests need alike: a self-signed certificate for a TLS server on loopback, and
waiting for a line a process prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

import pytest

from streamquake.errors import EXIT_NOT_JUDGED, EXIT_OK, EXIT_SLO_BROKEN
from streamquake.loadgen.attribution import Window, due_at, ended_at, window_at
from streamquake.loadgen.samples import RequestSample

TAIL = 3000


class Ended(Protocol):
    """A run that ended: a CompletedProcess, a Popen waited for, or a shared run's record."""

    @property
    def returncode(self) -> Any: ...


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _tail(proc: Ended, said: str) -> str:
    """The exit code and the last lines of what the run printed, for an assertion's message."""
    if said:
        return f"exit {proc.returncode}\n{said[-TAIL:]}"
    out, err = _text(getattr(proc, "stdout", None)), _text(getattr(proc, "stderr", None))
    shown = f"exit {proc.returncode}\n{out[-TAIL:]}"
    return shown + (f"\n--- stderr\n{err[-TAIL:]}" if err else "")


def not_judged_checks(out: Path) -> list[dict[str, Any]]:
    """The gating checks the run's report.json marks not judged (a saturated step)."""
    report = json.loads((out / "report.json").read_text())
    return [c for c in report["checks"]
            if c.get("gating") and c.get("ran", True) and c.get("not_judged")]


def assert_run_ok(proc: Ended,
                  out: Path | None = None, said: str = "") -> None:
    """The run ended with nothing broken: 0, or 6 where the saturation guard left a gating
    timing check unjudged (then, given its ``out``, the report says which and why). For a test
    about what a run writes or counts, not about its verdict. ``said``: the run's output where
    the process's own streams were read elsewhere (a Popen)."""
    assert proc.returncode in (EXIT_OK, EXIT_NOT_JUDGED), _tail(proc, said)
    if proc.returncode == EXIT_NOT_JUDGED and out is not None:
        unjudged = not_judged_checks(out)
        assert unjudged, "exit 6 with no check marked not judged in report.json\n" + \
            _tail(proc, said)
        assert all("saturated" in c["not_judged"] for c in unjudged), unjudged


def assert_verdict(proc: Ended,
                   expected: int, out: Path, deciding: set[str] | None = None,
                   said: str = "") -> bool:
    """A verdict test's exit code: ``expected`` (0: every SLO met, 1: one broken), or the
    outcome issue 30 defines for a saturated step, 6, where report.json marks the checks that
    would decide it (metric names in ``deciding``; any, when not given) not judged and none
    broke. True when the verdict was judged (``expected``), False when it was left unjudged,
    so the test can skip the claims that need a judged verdict."""
    if proc.returncode == expected:
        return True
    assert proc.returncode == EXIT_NOT_JUDGED and expected in (EXIT_OK, EXIT_SLO_BROKEN), \
        f"expected exit {expected}\n" + _tail(proc, said)
    unjudged = not_judged_checks(out)
    metrics = {c["metric"] for c in unjudged}
    assert unjudged and all("saturated" in c["not_judged"] for c in unjudged), \
        f"exit 6 without a saturated step's check in report.json: {unjudged}\n" + \
        _tail(proc, said)
    if deciding is not None:
        assert metrics & deciding, (f"exit 6, but the checks left unjudged ({sorted(metrics)}) "
                                    f"are not those that decide this verdict ({sorted(deciding)})")
    return False


def assert_run_ended(proc: Ended,
                     said: str = "") -> None:
    """The run ran to its end with a verdict, whichever: 0, 1, or 6 (not judged). For a test
    that reads what a run measured and wrote, whatever its SLOs made of it."""
    assert proc.returncode in (EXIT_OK, EXIT_SLO_BROKEN, EXIT_NOT_JUDGED), _tail(proc, said)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """``(cert.pem, key.pem)`` in ``directory``: a P-256 certificate for ``localhost`` and
    127.0.0.1, valid a day (openssl, as a user would make one)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


def wait_for_line(proc: subprocess.Popen[str], text: str, times: int = 1,
                  timeout_s: float = 60) -> list[str]:
    """Read ``proc``'s stdout until ``text`` has appeared on ``times`` lines; return the lines
    read. A process that ends first, or a deadline passed, fails the test with all it said (the
    process killed). The test's own timeout bounds a process that prints nothing at all."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.append(proc.stdout.readline())
        if sum(text in s for s in seen) >= times:
            return seen
        if not seen[-1] and proc.poll() is not None:
            break
    proc.kill()
    rest, _ = proc.communicate(timeout=60)
    pytest.fail(f"never saw {text!r} {times} time(s):\n" + "".join(seen) + (rest or ""))


def spared_by_fault(report: dict[str, Any], samples: list[RequestSample], step: str,
                    fault: str | None = None) -> int:
    """How many of ``step``'s requests a proxy fault on in that step may rightly leave alone:
    those sent before the fault was applied (a busy machine's apply lets a few through, and
    the proxy spares a stream it held before) and those still running when it was reverted
    (due in the step's last moments); at least 2. ``fault``: its name (default: the only
    one)."""
    record = next(f for f in report["faults"] if fault is None or f["name"] == fault)
    windows = [Window(p["name"], p["start"], p["end"]) for p in report["phases"]]
    mine = [x for x in samples
            if (w := window_at(due_at(x), windows)) is not None and w.name == step]
    early = sum(1 for x in mine if x.sent < record["applied_at"])
    crossing = sum(1 for x in mine if x.sent < record["reverted_at"] < ended_at(x))
    return max(2, early + crossing)


def read_send_log(path: Path) -> list[dict[str, Any]]:
    """The embedded target's ``send_log``: one dict per stream served."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def token_sent_ns(line: dict[str, Any]) -> list[int]:
    """When a ``send_log`` line's stream sent each of its tokens (epoch ns), in order."""
    return [t for t, token in zip(line["sent_ns"], line["content"], strict=True) if token]


# The fuzz tests' profile (tests/test_fuzz.py, tests/test_fuzz_scenarios.py): ``ci`` by default,
# ``nightly`` from scripts/fuzz (STREAMQUAKE_FUZZ_PROFILE).
FUZZ_PROFILE = os.environ.get("STREAMQUAKE_FUZZ_PROFILE", "ci")
if FUZZ_PROFILE not in ("ci", "nightly"):
    raise RuntimeError(f"STREAMQUAKE_FUZZ_PROFILE={FUZZ_PROFILE!r}: use 'ci' or 'nightly'")
NIGHTLY = FUZZ_PROFILE == "nightly"
