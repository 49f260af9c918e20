"""The shipped reference chaos plan on the host: its plan as a dry run, and, on a kernel without
netem, a refusal before anything changes (the GPUs of the emulated driver included). The run
itself is tests/uml/test_reference_chaos_plan.py, inside User-Mode Linux."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from streamquake.faults.tc.probe import kernel_features
from tests.conftest import run_cli
from tests.nvml_shim import FakeGpus

SCENARIO = "scenarios/reference-chaos-plan.yaml"


@pytest.mark.timeout(60)
def test_dry_run_plans_three_faults_each_between_its_before_and_after(
        tmp_path: Path, state_dir: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("run", SCENARIO, "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    steps = re.findall(r"^step (\S+) \((\w+)\)", text, re.M)
    assert steps == [("warm", "warmup"),
                     *[(f"{pre}{f}", kind) for f in ("jitter", "downclock", "drop")
                       for pre, kind in (("before-", "baseline"), ("", "fault"),
                                         ("after-", "recovery"))]], steps
    for fault, after in (("netem 'jitter'", "after-jitter"),
                         ("gpu_clocks 'downclock'", "after-downclock"),
                         ("sse_proxy 'drop'", "after-drop")):
        assert re.search(fr"{fault} .*reverted at \+\d+s as {after} begins", text), text
    assert "delay=100ms, jitter=30ms" in text and "sm_clocks_mhz=[500, 800]" in text
    assert "drop=15%" in text
    assert not out.exists() and not (state_dir / "journal.json").exists()


@pytest.mark.timeout(90)
def test_without_netem_it_refuses_before_touching_the_gpus(
        tmp_path: Path, state_dir: Path) -> None:
    if "netem" in kernel_features():
        pytest.skip("this kernel has netem: the refusal cannot be shown here (UML runs it)")
    gpus = FakeGpus(tmp_path / "nvml-state.txt", gpu_count=1)
    original = gpus.text()
    proc = run_cli("run", SCENARIO, "--out", str(tmp_path / "out"), env=gpus.env(), timeout=80)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert gpus.text() == original
    journal = state_dir / "journal.json"
    assert not journal.exists() or json.loads(journal.read_text()) == []
