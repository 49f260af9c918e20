"""Network faults through the real CLI on this kernel (tbf works here; netem does not, and the
run must say so): the target in its own namespace, kernel read-back in the report, and a
SIGKILLed run whose namespace, veth pair and qdiscs `streamquake recover` removes."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from streamquake.faults.tc.probe import kernel_features
from tests.conftest import REPO, cli_cmd, run_cli
from tests.helpers import assert_run_ok
from tests.timing import HANG_S, descendants, wait_until

TBF_SCENARIO = """
name: tbf-namespace
target:
  protocol: openai
  embedded: {{ttft: 50ms, itl: 10ms, output_tokens: {{min: 20, max: 20}}}}
  timeout: 10s
network: {{mode: namespace, scope: target, direction: both}}
load: {{users: 3, think_time: {{min: 50ms, max: 100ms}}}}
phases: {{warmup: 4s, baseline: 3s, fault: {fault_s}s, recovery: 3s}}
faults:
  - {{type: tbf, name: thin-pipe, phase: fault, rate: 2mbit, burst: 16kb, latency: 100ms}}
slos:
  - {{metric: error_rate, max: 0%}}
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _ours_in_kernel() -> set[str]:
    """Every namespace and host-side link streamquake names (sq-*, sqh*, sqifb*)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ({ln.split()[0] for ln in netns.splitlines() if ln.startswith("sq-")}
            | {ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()
               if ln.split(":")[1].strip().startswith(("sqh", "sqifb"))})


def _left_behind(before: set[str]) -> set[str]:
    # Only what appeared during the test: another run on the machine may come and go meanwhile.
    return _ours_in_kernel() - before


def _none_left(before: set[str]) -> set[str]:
    """Wait until nothing that appeared during the test is left. Other tests (another xdist
    worker, another run on the machine) make and remove their own namespaces meanwhile, with
    names no one can tell from a leak of ours, so each may stay while its test lasts; a leak
    stays for good, and the deadline (for a hang) then fails the test with its names."""
    wait_until(lambda: not _left_behind(before), "names that appeared during the test to go",
               timeout_s=HANG_S * 2)
    return _left_behind(before)


def _own_names(report: Path) -> set[str]:
    """The namespace and links a run made, named in its report.json (its target URL's topology
    and the kernel read-back): sq-<id>, sqh<id>, sqt<id>, sqifb<id>."""
    names = set(re.findall(r'"(sq(?:-|h|t|ifb)[0-9a-f]{8})"', report.read_text()))
    assert names, "report.json names no namespace or link of the run"
    return names


def _scenario(tmp_path: Path, fault_s: float) -> Path:
    path = tmp_path / "tbf.yaml"
    path.write_text(TBF_SCENARIO.format(fault_s=fault_s))
    return path


@pytest.mark.timeout(60)
def test_netem_on_a_kernel_without_it_exits_3_with_one_sentence(
    tmp_path: Path, state_dir: Path
) -> None:
    if "netem" in kernel_features():
        pytest.skip("this kernel has netem: the refusal cannot be shown here (UML tests cover it)")
    before = _ours_in_kernel()
    proc = run_cli("run", "scenarios/cross-region-jitter.yaml", "--out", str(tmp_path / "out"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _none_left(before) == set()
    journal = state_dir / "journal.json"
    assert not journal.exists() or json.loads(journal.read_text()) == []


@pytest.mark.timeout(90)
def test_tbf_in_a_namespace_runs_and_reports_the_kernel_view(
    tmp_path: Path, state_dir: Path
) -> None:
    out = tmp_path / "out"
    proc = run_cli("run", str(_scenario(tmp_path, 3)), "--out", str(out), timeout=80)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    (fault,) = report["faults"]
    assert fault["error"] is None and fault["reverted"] is not None
    assert "10.213." in report["target"]["url"]       # reached through the veth pair
    kernel = json.dumps(fault["applied"]["kernel"])
    assert "tbf" in kernel and "htb" in kernel and "u32" in kernel
    own = _own_names(out / "report.json")
    assert any(n.startswith("sq-") for n in own) and not own & _ours_in_kernel(), own


@pytest.mark.timeout(120)
def test_sigkill_mid_fault_then_recover_leaves_no_namespace_link_or_qdisc(
    tmp_path: Path, state_dir: Path
) -> None:
    before = _ours_in_kernel()
    scenario = _scenario(tmp_path, 60)
    proc = subprocess.Popen(
        cli_cmd("run", str(scenario), "--out", str(tmp_path / "out")), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "fault applied" not in (lines[-1] if lines else ""):
        lines.append(proc.stdout.readline())
        if not lines[-1] and proc.poll() is not None:
            break
    assert "fault applied" in lines[-1], "".join(lines)
    children = descendants(proc.pid)
    proc.kill()
    proc.communicate(timeout=10)
    # The target (in the namespace) is killed by PDEATHSIG: until it has gone, the namespace
    # and its veth pair are still in use. Polled for; the deadline is for a hang.
    wait_until(lambda: not any(_running(c) for c in children), "the run's children to end")

    journal = json.loads((state_dir / "journal.json").read_text())
    # The fault, the run's scaffold on the link (htb tree and filters, built once per run) and
    # the namespace, each its own entry.
    assert sorted(e["type"] for e in journal) == ["netns", "tbf", "tc_scaffold"]
    topology = next(e for e in journal if e["type"] == "netns")["state"]
    host_if = topology["host_ifname"]
    assert {topology["netns"], host_if} <= _left_behind(before), "the kill should leave them"
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", host_if], capture_output=True,
                           text=True).stdout
    assert "htb 5351:" in qdisc, qdisc          # ...and our shaping on its host end

    refused = run_cli("run", str(scenario), "--out", str(tmp_path / "out2"))
    assert refused.returncode == 3 and "streamquake recover" in refused.stderr

    recovered = run_cli("recover")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert recovered.stdout.count("recovered ") == 3
    assert not {topology["netns"], host_if} & _ours_in_kernel()
    assert json.loads((state_dir / "journal.json").read_text()) == []
