"""User-Mode Linux on every host: the XSAVE shim (scripts/uml_xstate_shim.c) and the boot-failure
sentence of scripts/uml-run.

On hosts whose XSAVE area is larger than UML's FP register buffer (CPUs with AMX) Debian's UML
panics at boot unless the shim pads its NT_X86_XSTATE ptrace calls. These tests run the shim's
full-buffer path on any host (UML_XSTATE_SHIM=force) as well as its automatic mode, and check that
FP and vector registers survive many context switches inside the guest bit for bit.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UML_RUN = REPO / "scripts" / "uml-run"
PROCS, ITERATIONS = 4, 10_000_000
LINE = re.compile(r"^proc (\d+) (x87=\S+ sse=\S+ avx=\S+ avx512=\S+) preempted=(\d+)$", re.M)


def cpu_has(flag: str) -> bool:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    return re.search(rf"^flags\s*:.*\b{flag}\b", cpuinfo, re.M) is not None


@pytest.fixture(scope="module")
def fp_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Under /tmp: the guest sees the host's root through hostfs.
    exe = tmp_path_factory.mktemp("fp") / "fp_roundtrip"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(exe),
                    str(REPO / "tests" / "uml" / "fp_roundtrip.c")], check=True, timeout=60)
    return exe


def results(out: str) -> tuple[dict[int, str], int]:
    found = LINE.findall(out)
    assert len(found) == PROCS, out[-3000:]
    return {int(i): bits for i, bits, _ in found}, sum(int(p) for _, _, p in found)


@pytest.fixture(scope="module")
def on_host(fp_program: Path) -> dict[int, str]:
    proc = subprocess.run([str(fp_program), str(PROCS), str(ITERATIONS)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return results(proc.stdout)[0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["force", "auto"])
def test_fp_and_vector_registers_survive_context_switches_in_uml(
        mode: str, fp_program: Path, on_host: dict[int, str]) -> None:
    env = {**os.environ, "UML_XSTATE_SHIM": mode}
    proc = subprocess.run([str(UML_RUN), "--timeout", "150", "--", str(fp_program), str(PROCS),
                           str(ITERATIONS)], capture_output=True, text=True, timeout=180,
                          env=env, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    in_guest, preempted = results(out)
    # Each process was preempted mid-loop many times; without that nothing was round-tripped.
    assert preempted >= 4 * PROCS, out[-3000:]
    assert in_guest == on_host
    if mode == "force":
        assert "uml-xstate-shim: forced:" in out, out[-3000:]
    elif cpu_has("amx_tile"):
        assert "uml-xstate-shim: active:" in out, out[-3000:]


@pytest.mark.timeout(60)
def test_a_boot_that_cannot_restore_fp_registers_fails_with_one_sentence(tmp_path: Path) -> None:
    """The console lines are the ones UML 6.1 prints on an AMX host; the kernel here is a stand-in
    that prints them and dies, because this host's UML boots."""
    fake = tmp_path / "linux.uml"
    fake.write_text("#!/bin/sh\n"
                    "echo 'userspace - ptrace set fp regs failed, errno = 14'\n"
                    "echo 'Kernel panic - not syncing: Attempted to kill init!'\n"
                    "exit 1\n")
    fake.chmod(0o755)
    for shim_mode, says in [("auto", "even with the XSAVE shim"),
                            ("off", "the shim that pads it is turned off")]:
        proc = subprocess.run([str(UML_RUN), "--timeout", "30", "--", "true"], cwd=REPO,
                              capture_output=True, text=True, timeout=50,
                              env={**os.environ, "UML_KERNEL": str(fake),
                                   "UML_XSTATE_SHIM": shim_mode})
        assert proc.returncode == 90
        why = [ln for ln in proc.stderr.splitlines() if ln.startswith("uml-run: ")]
        assert len(why) == 1, proc.stderr
        assert "ptrace set fp regs failed, errno = 14" in why[0]
        assert ("has AMX (amx_tile)" if cpu_has("amx_tile") else "has no AMX") in why[0]
        assert says in why[0]
