"""Where the reports go can fail: --out naming a file, a read-only file system, a disk that fills
up during the run. Each gets one sentence and an exit code that is never 1 (which means an SLO
broke); a full disk loses only the file being written, and the verdict still reaches the
terminal. Also `run --dry-run`, which changes nothing. Real file systems: tmpfs mounts that the
test makes (root)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_cmd, run_cli

SCENARIO = """
name: outputs
target:
  protocol: openai
  embedded: {ttft: 20ms, itl: 5ms, output_tokens: {min: 5, max: 5}}
load: {users: 2, think_time: {min: 50ms, max: 100ms}}
phases: {warmup: 4s, baseline: 2s, fault: 1s, recovery: 1s}
faults:
  - {type: sse_proxy, name: slow, phase: fault, delay: 5ms}
slos:
  - {metric: error_rate, max: 1%}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "outputs.yaml"
    path.write_text(SCENARIO)
    return path


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(60)
def test_out_naming_a_file_is_a_usage_error(tmp_path: Path, scenario: Path) -> None:
    afile = tmp_path / "report.txt"
    afile.write_text("mine")
    proc = run_cli("run", str(scenario), "--out", str(afile))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"Error: --out {afile} is a file, not a directory: give a "
                                   "directory (it is created if missing)")
    assert afile.read_text() == "mine"


@pytest.mark.timeout(60)
def test_a_read_only_out_is_refused_before_the_run(scenario: Path, small_fs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    proc = run_cli("run", str(scenario), "--out", str(small_fs / "out"))
    assert proc.returncode == 3
    assert "Error: cannot write the reports to --out" in proc.stderr
    assert "Read-only file system" in proc.stderr
    assert "starting" not in proc.stdout           # refused before anything started


@pytest.mark.timeout(90)
def test_a_disk_that_fills_up_loses_only_the_files_being_written(scenario: Path,
                                                                 small_fs: Path) -> None:
    out = small_fs / "out"
    proc = subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(out)), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "waiting for in-flight requests" in line:
            # The load is done; fill the disk before any report is written.
            subprocess.run(["dd", "if=/dev/zero", f"of={small_fs / 'filler'}", "bs=64k"],
                           capture_output=True, check=False)
            break
    rest, err = proc.communicate(timeout=60)
    stdout = "".join(lines) + rest
    assert proc.returncode == 3, stdout + err
    # The verdict reached the terminal (met; or met as far as judged where a saturated step left
    # a timing out: the run's words for that, README "Commands and exit codes").
    assert "SLOs MET" in stdout, stdout
    assert "Error: could not write" in err and "No space left on device" in err
    assert "the verdict above stands" in err
    leftovers = sorted(p.name for p in out.iterdir() if p.is_file())
    assert not [n for n in leftovers if n.endswith(".tmp")], leftovers
    assert "report.json" not in leftovers           # never a truncated report


@pytest.mark.timeout(60)
def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path: Path, state_dir: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("run", "scenarios/cross-region-jitter.yaml", "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "nothing is started or changed" in text
    assert "sq-<id>" in text and "netem 'cross-region-jitter'" in text
    assert "+20s to +40s (fault)" in text
    assert "only packets to and from the target's address and port" in text
    assert "streamquake recover" in text
    assert not out.exists() and not (state_dir / "journal.json").exists()
