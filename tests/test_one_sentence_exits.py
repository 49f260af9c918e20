"""Issue 37, items 10 and 11: every exit path is one sentence and its documented code.

Each command below once ended in a traceback (exit 1, which CI reads as "regression") or took a
meaningless value (port 0, a read timeout of 0, an empty bind address, -1 resamples, a device as
a run). Each is now refused at once with one ``Error:`` sentence that names the option, and exit
2, before anything is started, read or bound.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli

GOOD = "tests/scenarios/good_minimal.yaml"


@pytest.fixture
def runs(tmp_path: Path) -> tuple[str, str]:
    """Two saved runs of one scenario (report.json as `run --out` writes its head)."""
    dirs = []
    for side in ("a", "b"):
        d = tmp_path / side
        d.mkdir()
        (d / "report.json").write_text(json.dumps({"schema": "streamquake.report/1",
                                                   "phases": []}))
        dirs.append(str(d))
    return dirs[0], dirs[1]


def _refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    text = done.stdout + done.stderr
    assert "Traceback" not in text, text[-2000:]
    assert done.returncode == 2, text[-2000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    assert all(w in errors[0] for w in words), errors[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, words", [
    (["--markdown", ""], ["--markdown", "a file to write"]),
    (["--json", "/nonexistent-dir/c.json"], ["--json", "a folder that exists"]),
    (["--resamples", str(10**20)], ["--resamples", "100000"]),
    (["--resamples", "-1"], ["--resamples -1"]),
])
def test_compare_options_are_checked_first(runs: tuple[str, str], extra: list[str],
                                           words: list[str]) -> None:
    _refused(run_cli("compare", *runs, *extra, timeout=60), *words)
    assert run_cli("compare", *runs, timeout=60).returncode == 0   # the runs themselves compare


@pytest.mark.timeout(60)
def test_compare_refuses_a_device_for_a_run_without_reading_it(runs: tuple[str, str]) -> None:
    _refused(run_cli("compare", runs[0], "/dev/zero", timeout=30), "/dev/zero",
             "not a run directory")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, words", [
    (["validate", GOOD, "--set", "faults.\u00b2.delay=1ms"], ["--set", "ASCII digits"]),
    (["validate", GOOD, "--set", f"faults.{'9' * 5000}.delay=1ms"], ["5000 digits"]),
    (["probe", "--url", "http://127.0.0.1:9/v1", "--path", " 5 "], ["target.path", "%20"]),
    (["worker", "--master", "localhost:\u00b2", "--connect-timeout", "1s"], ["--master"]),
    (["worker", "--master", "1" * 300, "--connect-timeout", "1s"], ["--master", "253"]),
    (["inject", "tbf", "rate=1mbit", "--target", "localhost:0", "--for", "1s"],
     ["--target", "1-65535"]),
    (["proxy", "--upstream", "http://127.0.0.1:9", "--read-timeout", "0"],
     ["--read-timeout 0", "100ms"]),
    (["target", "serve", "--host", ""], ["--host ''"]),
])
def test_a_wrong_option_is_one_sentence_and_exit_2(args: list[str], words: list[str]) -> None:
    _refused(run_cli(*args, timeout=30), *words)


@pytest.mark.timeout(60)
def test_a_state_dir_that_is_a_file_is_one_sentence(tmp_path: Path) -> None:
    a_file = tmp_path / "state"
    a_file.write_text("not a directory")
    _refused(run_cli("agent", "--state-dir", str(a_file), timeout=30), "--state-dir",
             str(a_file))
    assert a_file.read_text() == "not a directory"
