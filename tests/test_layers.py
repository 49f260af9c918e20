"""The import contract (pyproject's [tool.importlinter]: one-way layers, no circles, no gevent in
the header templates, fault families' internals private and families independent) holds, and it
has teeth: one upward import, one circle, one path to gevent, one reach into a family's
internals or one family importing another, planted in a copy of the package, breaks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contract() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "5 kept, 0 broken" in done.stdout


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "streamquake", tmp_path / "streamquake",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _planted() -> None:\n    {line}\n")


def test_an_import_up_the_layers_breaks_the_contract(copy: Path) -> None:
    # A low module reaching up into the run, inside a function (imports there count too).
    _plant(copy / "streamquake" / "units.py", "import streamquake.run.runner  # noqa")
    done = _lint(copy)
    assert done.returncode != 0
    assert "streamquake.units is not allowed to import streamquake.run" in done.stdout


def test_a_circle_inside_a_package_breaks_the_contract(copy: Path) -> None:
    # Two reporters importing each other: no layer rule between them, only the circle rule.
    _plant(copy / "streamquake" / "reports" / "junit.py", "import streamquake.reports.markdown")
    _plant(copy / "streamquake" / "reports" / "markdown.py", "import streamquake.reports.junit")
    done = _lint(copy)
    assert done.returncode != 0
    assert "No cycles are allowed in streamquake.reports" in done.stdout


def test_gevent_reached_from_the_templates_breaks_the_contract(copy: Path) -> None:
    # The header templates reaching the socket stamps: gevent comes in one module away.
    _plant(copy / "streamquake" / "loadgen" / "templates.py",
           "import streamquake.loadgen.stamps  # noqa")
    done = _lint(copy)
    assert done.returncode != 0
    assert "streamquake.loadgen.templates is not allowed to import gevent" in done.stdout


def test_a_reach_into_a_familys_internals_breaks_the_contract(copy: Path) -> None:
    # The agent reading the proxy family's spec instead of going through the catalog.
    _plant(copy / "streamquake" / "agent" / "holder.py",
           "import streamquake.faults.proxy.spec  # noqa")
    done = _lint(copy)
    assert done.returncode != 0
    assert "A fault family's internals are imported only inside faults/ BROKEN" in done.stdout
    assert "- streamquake.agent.holder -> streamquake.faults.proxy.spec" in done.stdout


def test_one_family_importing_another_breaks_the_contract(copy: Path) -> None:
    # The tc family borrowing the proxy family's address parser.
    _plant(copy / "streamquake" / "faults" / "tc" / "profiles.py",
           "import streamquake.faults.proxy.standing  # noqa")
    done = _lint(copy)
    assert done.returncode != 0
    assert "No fault family imports another BROKEN" in done.stdout
    assert "streamquake.faults.tc is not allowed to import streamquake.faults.proxy" \
        in done.stdout
