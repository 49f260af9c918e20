"""Shared test helpers: run the real CLI in a subprocess, with its own journal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns_fixtures import client_ns, serve, topo

__all__ = ["client_ns", "serve", "topo"]  # fixtures for the network tests

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private fault journal for every test, so no test sees (or leaves) a real one."""
    d = tmp_path / "state"
    monkeypatch.setenv("STREAMQUAKE_STATE_DIR", str(d))
    return d


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamquake", *args]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cli_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or REPO)
