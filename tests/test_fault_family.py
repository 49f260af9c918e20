"""The fault-family contract, proven the way CREATING_FAULTS.md says to add a family: the example
family in tests/example_family (one folder) is found by the catalog, validated with located
errors, run through the real CLI, recovered after a SIGKILL, and a fault removed under a live run
is reported; its agent allowlist option (`--allow-dirs`) comes from its folder alone, and an agent
refuses a fault outside it. Also: the catalog holds the built-in families once each, and
`validate` imports no heavy library."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from streamquake.faults import catalog
from streamquake.journal import Journal
from tests.conftest import REPO, cli_cmd, run_cli
from tests.helpers import assert_run_ok, wait_for_line
from tests.test_agent import call, start_agent, stop_agent

FAMILY_ENV = {"STREAMQUAKE_FAULT_FAMILIES": "tests.example_family"}

SCENARIO = """\
name: example-family
target:
  protocol: openai
  embedded: {{ttft: 30ms, itl: 5ms, output_tokens: {{min: 5, max: 5}}}}
load: {{users: 2, think_time: {{min: 50ms, max: 100ms}}}}
phases: {{warmup: 1s, baseline: 2s, fault: {fault_s}s, recovery: 2s}}
faults:
  - {{type: marker_file, name: flag, phase: fault, path: {path}, mode: "600"}}
slos:
  - {{metric: error_rate, max: 1%}}
"""


def _scenario(tmp_path: Path, flag: Path | str, fault_s: float = 3) -> Path:
    path = tmp_path / "example.yaml"
    path.write_text(SCENARIO.format(path=flag, fault_s=fault_s))
    return path


def _start(scenario: Path, out: Path, state_dir: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, **FAMILY_ENV, "STREAMQUAKE_STATE_DIR": str(state_dir)}
    return subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(out), *extra), cwd=REPO,
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)




@pytest.mark.timeout(60)
def test_catalog_holds_each_builtin_family_once() -> None:
    names = [f.name for f in catalog.families()]
    assert names == sorted(set(names)) and {"gpu", "proxy", "tc"} <= set(names)
    assert {"gpu_clocks", "netem", "sse_proxy", "tbf"} <= set(catalog.fault_types())
    assert "netns" in catalog.resource_journal_types()


@pytest.mark.timeout(60)
def test_validate_imports_no_heavy_library() -> None:
    code = ("import sys; from streamquake.scenario import load_scenario; "
            "[load_scenario(f'scenarios/{n}.yaml') for n in ('quickstart', "
            "'cross-region-jitter', 'gpu-downclock')]; "
            "print(sorted(m for m in ('pyroute2', 'pynvml', 'aiohttp', 'locust', 'gevent') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(60)
def test_example_family_is_found_and_validated(tmp_path: Path) -> None:
    good = _scenario(tmp_path, tmp_path / "flag")
    unknown = run_cli("validate", str(good))
    assert unknown.returncode == 2
    assert "faults.0.type: 'marker_file' is not a type known here (hint: one of: " in \
        unknown.stderr

    ok = run_cli("validate", str(good), env=FAMILY_ENV)
    assert ok.returncode == 0, ok.stderr
    assert "faults: flag (marker_file, fault)" in ok.stdout

    bad = run_cli("validate", str(_scenario(tmp_path, "relative/flag")), env=FAMILY_ENV)
    assert bad.returncode == 2
    assert bad.stderr == (f"Error: {tmp_path / 'example.yaml'}:8:51: faults.0.path: must be an "
                          "absolute path, e.g. /tmp/streamquake-flag\n")


@pytest.mark.timeout(120)
def test_example_family_runs_and_reverts(tmp_path: Path, state_dir: Path) -> None:
    flag, out = tmp_path / "flag", tmp_path / "out"
    proc = _start(_scenario(tmp_path, flag), out, state_dir)
    wait_for_line(proc, "fault applied")
    assert flag.read_text() == "fault on"          # the fault is real while its phase lasts
    assert stat.S_IMODE(flag.stat().st_mode) == 0o600      # its own scenario option, `mode`
    rest, _ = proc.communicate(timeout=60)
    assert_run_ok(proc, out, said=rest)
    assert not flag.exists()
    report = json.loads((out / "report.json").read_text())
    (record,) = report["faults"]
    assert record["type"] == "marker_file" and record["phase"] == "fault"
    assert record["configured"]["path"] == str(flag)        # the default describe: the spec
    assert record["configured"]["mode"] == "600"
    assert record["applied"] == {"path": str(flag), "bytes": 8}
    assert record["reverted"] == {"removed": True} and record["error"] is None
    assert report["telemetry"]["stopwatch"]["up_s"] > 5    # its run-long resource was up
    # Its telemetry is charted in report.html as a GPU's is: the family said how, nothing else.
    html = (out / "report.html").read_text()
    assert "<h2>Example stopwatch</h2>" in html and 'data-chart="stopwatch-up_s"' in html
    assert json.loads((state_dir / "journal.json").read_text()) == []


@pytest.mark.timeout(120)
def test_example_family_killed_then_recovered(tmp_path: Path, state_dir: Path) -> None:
    flag = tmp_path / "flag"
    # The journal path on its own, as when the watchdog is gone too (its lease: lifecycle tests).
    proc = _start(_scenario(tmp_path, flag, fault_s=60), tmp_path / "out", state_dir,
                  "--no-watchdog")
    wait_for_line(proc, "fault applied")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    assert flag.exists()
    (entry,) = json.loads((state_dir / "journal.json").read_text())
    assert entry["type"] == "marker_file" and entry["state"] == {"path": str(flag)}

    recovered = run_cli("recover", env=FAMILY_ENV)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert f"recovered flag (marker_file, applied by pid {proc.pid}): removed {flag}" in \
        recovered.stdout
    assert not flag.exists()
    assert json.loads((state_dir / "journal.json").read_text()) == []


@pytest.mark.timeout(120)
def test_a_live_runs_fault_is_left_alone_and_one_removed_under_it_is_reported(
        tmp_path: Path, state_dir: Path) -> None:
    flag, out = tmp_path / "flag", tmp_path / "out"
    proc = _start(_scenario(tmp_path, flag, fault_s=6), out, state_dir)
    wait_for_line(proc, "fault applied")

    # `recover` while the run is alive: its entry belongs to a live owner and is not touched.
    skipped = run_cli("recover", env=FAMILY_ENV)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert f"skipped flag (marker_file): owned by the running process {proc.pid}" in \
        skipped.stdout
    assert flag.exists()

    # Another process removes it anyway (by hand, say): the run must not claim a clean fault.
    journal = Journal(state_dir / "journal.json")
    (entry,) = journal.entries()
    journal.remove(entry["id"])
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, rest
    report = json.loads((out / "report.json").read_text())
    (record,) = report["faults"]
    assert "removed under this run by another process" in record["error"]
    assert any("removed under this run" in e for e in report["errors"])


@pytest.mark.timeout(90)
def test_an_agent_takes_the_example_familys_allowlist_and_refuses_outside_it(
        tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    # The option is the family's: `agent` has it only where the family is found.
    assert "--allow-dirs" in run_cli("agent", "--help", env=FAMILY_ENV).stdout
    assert "--allow-dirs" not in run_cli("agent", "--help").stdout
    bad = run_cli("agent", "--allow-dirs", "relative/dir", env=FAMILY_ENV)
    assert bad.returncode == 2
    assert "--allow-dirs: relative/dir is not an absolute directory" in bad.stderr

    agent = start_agent(tmp_path, "a", "--allow-dirs", str(allowed))
    try:
        status, info = call(agent.url, "GET", "/v1/info")
        assert status == 200, info
        assert info["allow"]["dirs"] == [str(allowed)]            # type: ignore[index]
        assert info["capabilities"]["tmp_writable"] is True       # type: ignore[index]
        assert f"marker directories {allowed}" in agent.text()

        for outside in (tmp_path / "flag", allowed / ".." / "flag"):
            status, body = call(agent.url, "POST", "/v1/faults", {
                "fault": {"type": "marker_file", "path": str(outside)}, "lease": "30s"})
            assert (status, body["error"]) == (403, (
                f"this agent may not put a marker at {outside}; it may put them only under "
                f"{allowed} (its --allow-dirs)"))
        assert not (tmp_path / "flag").exists()

        inside = allowed / "flag"
        status, held = call(agent.url, "POST", "/v1/faults", {
            "fault": {"type": "marker_file", "path": str(inside), "mode": "600"},
            "lease": "30s"})
        assert status == 201, held
        assert stat.S_IMODE(inside.stat().st_mode) == 0o600
        status, body = call(agent.url, "DELETE", f"/v1/faults/{held['id']}")
        assert status == 200 and not inside.exists(), body
    finally:
        stop_agent(agent)
