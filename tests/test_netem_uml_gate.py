"""The netem tests need a kernel with sch_netem, which this machine's lacks: boot User-Mode Linux
(scripts/uml-run) and run tests/uml in it. This fails, never skips, when UML cannot boot (uml-run
then says why in one sentence: on a CPU whose XSAVE area UML cannot handle, which CPU, the errno
and what to install) or any test inside fails or is skipped. UML_XSTATE_SHIM=force in the
environment runs it all through the ptrace shim's full-buffer path, as AMX hosts do. About 5
minutes: a 2.5 s boot, the netem tests, then the netem scenarios through the CLI
(tests/uml/test_scenarios_in_uml.py, about 2.5 minutes) and the reference chaos plan against the
emulated NVIDIA driver (tests/uml/test_reference_chaos_plan.py, about 2.5 minutes).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UML_TIMEOUT_S = 1200     # for a hang: the run takes 5-6 min, more on a busy host
MIN_INNER_TESTS = 16


@pytest.mark.timeout(UML_TIMEOUT_S + 30)
def test_netem_tests_pass_inside_user_mode_linux() -> None:
    cmd = [str(REPO / "scripts" / "uml-run"), "--timeout", str(UML_TIMEOUT_S), "--",
           sys.executable, "-m", "pytest", "-m", "uml", "tests/uml", "-q", "-rfEs",
           "-p", "no:cacheprovider", "--color=no"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          timeout=UML_TIMEOUT_S + 20)
    out = (proc.stdout + proc.stderr).replace("\r", "")
    tail = "\n".join(out.splitlines()[-60:])
    # uml-run's own sentence (why UML could not boot, or how the command ended) comes first.
    why = "\n".join(ln for ln in out.splitlines() if ln.startswith("uml-run"))
    assert proc.returncode == 0, f"scripts/uml-run exited with {proc.returncode}: {why}\n{tail}"
    summary = re.search(r"^=* ?(\d+) passed.* in [\d.]+s", out, re.M)
    assert summary, f"no pytest summary from inside UML:\n{tail}"
    assert int(summary.group(1)) >= MIN_INNER_TESTS, tail
    assert not re.search(r"\d+ (skipped|failed|error)", summary.group(0)), tail
