"""CLI habits through the real CLI: --version, shell completion, `faults` (every type and its
parameters, from the spec models), `schema` (the scenario's JSON Schema, accepting durations as
written), and inject/status/revert usage errors that start nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamquake import __version__
from tests.conftest import run_cli

FAMILY_ENV = {"STREAMQUAKE_FAULT_FAMILIES": "tests.example_family"}


@pytest.mark.timeout(30)
def test_version_and_shell_completion() -> None:
    proc = run_cli("--version")
    assert (proc.returncode, proc.stdout) == (0, f"streamquake {__version__}\n")
    # The shell is named, not detected from this process's ancestors (a CI runner's may have
    # no shell at all): typer's own switch for that.
    completion = run_cli("--show-completion", "bash",
                         env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert completion.returncode == 0
    assert "complete " in completion.stdout and "_COMPLETE" in completion.stdout
    # What bash asks the installed command for, as `streamquake inject ne<TAB>` would.
    script = Path(sys.executable).parent / "streamquake"
    for words, cword, want in (("streamquake inject ne", "2", "netem"),
                               ("streamquake sta", "1", "status")):
        asked = subprocess.run([str(script)], capture_output=True, text=True, timeout=30,
                               env={**os.environ, "_STREAMQUAKE_COMPLETE": "complete_bash",
                                    "COMP_WORDS": words, "COMP_CWORD": cword})
        assert asked.stdout.split() == [want], asked


@pytest.mark.timeout(30)
def test_faults_lists_every_type_with_its_parameters() -> None:
    proc = run_cli("faults", "--json", env=FAMILY_ENV)
    assert proc.returncode == 0, proc.stderr
    docs = {d["type"]: d for d in json.loads(proc.stdout)}
    assert set(docs) == {"cache_flush", "gpu_clocks", "marker_file", "netem", "noisy_tenant",
                         "sse_proxy", "tbf"}
    assert docs["marker_file"]["family"] == "example"
    params = {p["name"]: p for p in docs["netem"]["params"]}
    assert params["delay"]["type"] == "duration" and params["delay"]["default"] == "0ms"
    assert params["loss"]["type"] == "percentage" and params["rate"]["type"] == "rate"
    assert params["distribution"]["type"] == "'normal' | 'pareto' | 'paretonormal'"
    assert not {"type", "name", "phase", "at"} & set(params)      # the envelope, said once
    tbf = {p["name"]: p for p in docs["tbf"]["params"]}
    assert tbf["rate"]["required"] and tbf["latency"]["default"] == "50ms"
    marker = {p["name"]: p for p in docs["marker_file"]["params"]}
    assert marker["path"] == {"name": "path", "type": "text", "required": True,
                              "default": None, "description": ""}

    text = run_cli("faults", env=FAMILY_ENV)
    assert text.returncode == 0
    assert "Every fault also takes: name, phase, at" in text.stdout
    assert "sm_clocks_mhz" in text.stdout and "[integer, integer]" in text.stdout


@pytest.mark.timeout(30)
def test_schema_is_the_scenarios_json_schema(tmp_path: Path) -> None:
    proc = run_cli("schema", env=FAMILY_ENV)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert {"name", "target", "phases", "steps", "faults", "agents"} <= set(schema["properties"])
    assert schema["required"] == ["name", "target"]
    assert schema["oneOf"] == [{"required": ["phases"]}, {"required": ["steps"]}]
    defs = schema["$defs"]
    union = schema["properties"]["faults"]["items"]
    assert set(union["discriminator"]["mapping"]) == {"cache_flush", "gpu_clocks",
                                                       "marker_file", "netem", "noisy_tenant",
                                                       "sse_proxy", "tbf"}
    # Durations and percentages are accepted as a scenario writes them, not only as numbers.
    baseline = defs["PhasesSpec"]["properties"]["baseline"]["anyOf"]
    assert any(v.get("type") == "number" for v in baseline)   # its 100 ms floor: a validator
    assert any(v.get("type") == "string" and "1m30s" in v["description"] for v in baseline)
    netem = defs["NetemFault"]["properties"]
    assert any(v.get("type") == "string" for v in netem["loss"]["anyOf"])
    assert "at" in netem and defs["NetemFault"]["additionalProperties"] is False
    assert set(defs["AgentRef"]["required"]) == {"name", "url"}


@pytest.mark.timeout(60)
def test_inject_usage_errors_exit_2_and_start_no_agent(state_dir: Path) -> None:
    cases = {
        ("inject", "chaos_monkey", "--for", "1m"): "no fault family offers type 'chaos_monkey'",
        ("inject", "marker_file", "path=/tmp/x"): "give --for: how long to hold the fault",
        ("inject", "marker_file", "path=/tmp/x", "--for", "30s1m"): "--for: expected a "
        "duration like '100ms' or '30s': write the units largest first",
        ("inject", "marker_file", "path=relative", "--for", "1m"): "marker_file.path: must be "
        "an absolute path",
        ("inject", "marker_file", "path", "--for", "1m"): "'path': write parameters as "
        "key=value",
        ("inject", "marker_file", "path=/tmp/x", "phase=fault", "--for", "1m"): "phase=... "
        "does not apply to inject",
        ("revert",): "give a fault's NAME (see `streamquake status`) or --all",
        # A misspelt parameter: the closest one, and the list (it was pydantic's "Extra inputs
        # are not permitted").
        ("inject", "sse_proxy", "dorp=15%", "--for", "1m"): "sse_proxy has no parameter "
        "'dorp': did you mean 'drop'? its parameters: abort, corrupt, delay,",
    }
    for args, message in cases.items():
        proc = run_cli(*args, env=FAMILY_ENV)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
    status = run_cli("status", env=FAMILY_ENV)
    assert status.returncode == 0
    assert "the local agent is not running, so it holds no fault" in status.stdout
    as_json = run_cli("status", "--json", env=FAMILY_ENV)
    assert json.loads(as_json.stdout)["faults"] == []
    assert not (state_dir / "local-agent" / "local.json").exists()


@pytest.mark.timeout(90)
def test_run_json_prints_only_the_verdicts_on_stdout(tmp_path: Path) -> None:


    scenario = tmp_path / "j.yaml"
    scenario.write_text(
        "name: json\ntarget: {protocol: openai, embedded: {ttft: 10ms, itl: 2ms, "
        "output_tokens: {min: 3, max: 3}}}\nload: {users: 2, think_time: {min: 50ms, max: "
        "80ms}}\nphases: {warmup: 0.5s, baseline: 2s, fault: 0s, recovery: 0s}\n"
        "slos: [{metric: error_rate, max: 1%}, {metric: ttft_ms, percentile: 50, max: 10s}]\n"
        "verdicts: {saturated: fail}\n")
    # The file's SLO is met with ease; the --set override makes it one that breaks. On a busy
    # machine the load generator may be saturated: its TTFT is then not judged, and fails as
    # the scenario says (verdicts.saturated: fail), so the override breaks the run either way.
    proc = run_cli("run", str(scenario), "--out", str(tmp_path / "out"), "--json",
                   "--set", "slos.1.max=1ms")
    assert proc.returncode == 1, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)                   # stdout is exactly one JSON document
    assert doc["schema"] == "streamquake.verdicts/1" and doc["exit_code"] == 1
    assert doc["broken"] == ["ttft_ms p50 <= 1ms in baseline"]
    by_name = {c["name"]: c for c in doc["checks"]}
    assert by_name["error_rate <= 1%"]["state"] == "met"
    assert by_name["ttft_ms p50 <= 1ms"]["samples"] > 0
    assert "phase baseline" in proc.stderr            # the people's part went to stderr


SCENARIO = """\
name: v
target: {protocol: openai, embedded: {ttft: 10ms}}
load: {users: 2}
phases: {warmup: 1s, baseline: 2s, fault: 2s, recovery: 2s}
faults: [{type: sse_proxy, name: drop, drop: 10%}]
slos: [{metric: chunk_loss, max: 1%}]
"""


@pytest.mark.timeout(60)
def test_validate_json_set_overrides_and_warnings(tmp_path: Path) -> None:
    scenario = tmp_path / "v.yaml"
    scenario.write_text(SCENARIO)
    proc = run_cli("validate", str(scenario), "--json", "--set", "load.users=7",
                   "--set", "phases.fault=1m30s", "--set", "target.embedded.itl=5ms")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["scenario"]["users"] == 7 and doc["scenario"]["phases"]["fault"] == 90
    assert doc["scenario"]["faults"] == [{"name": "drop", "type": "sse_proxy", "phase": "fault",
                                          "at": "local"}]
    # chunk_loss against a target that numbers no events cannot be measured: said up front.
    (warning,) = doc["warnings"]
    assert "chunk_loss" in warning and "sse_event_ids" in warning
    text = run_cli("validate", str(scenario))
    assert text.returncode == 0 and "OK" in text.stdout and "warning: chunk_loss" in text.stderr
    fixed = run_cli("validate", str(scenario), "--json",
                    "--set", "target.embedded.sse_event_ids=true")
    assert json.loads(fixed.stdout)["warnings"] == []

    for override, said in (
        ("load.users=many", f"{scenario} (--set load.users=many): load.users: Input should be a "
                            "valid integer"),
        ("load.userz=3", f"{scenario} (--set load.userz=3): load.userz: unknown field (hint: "
                         "did you mean 'users'?"),
        ("faults.4.drop=1%", "--set faults.4.drop=1%: faults is a list of 1: write an index "
                             "from 0 to 0 after 'faults.'"),
        ("name.x=1", "--set name.x=1: name is the string 'v', not a mapping or a list, so it "
                     "has no 'x'"),
        ("load.users", "--set load.users: write KEY=VALUE"),
    ):
        bad = run_cli("validate", str(scenario), "--set", override)
        assert bad.returncode == 2, (override, bad.stdout, bad.stderr)
        assert said in bad.stderr, (override, bad.stderr)
    bad_json = run_cli("validate", str(scenario), "--json", "--set", "load.users=0")
    assert bad_json.returncode == 2
    doc = json.loads(bad_json.stdout)
    assert doc["ok"] is False and "load.users" in doc["problems"][0]
