"""The public surface is exactly what streamquake.__all__ says, every name resolves, and
importing the package pulls in none of the heavy parts (they load on first use)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import streamquake

PUBLIC = {
    "EXIT_ENVIRONMENT", "EXIT_OK", "EXIT_REVERT_FAILED", "EXIT_SCENARIO", "EXIT_SLO_BROKEN",
    "Family", "FaultSpec", "FaultType", "Injector", "InjectorError", "PreflightError",
    "Resource", "RunContext", "RunResult", "Runner", "Scenario", "ScenarioError",
    "StreamquakeError", "TargetError", "Wiring", "__version__", "load_scenario",
    "parse_scenario",
}


@pytest.mark.timeout(30)
def test_all_is_the_public_surface_and_every_name_resolves() -> None:
    assert set(streamquake.__all__) == PUBLIC
    assert len(streamquake.__all__) == len(PUBLIC)
    for name in streamquake.__all__:
        assert getattr(streamquake, name) is not None, name
    with pytest.raises(AttributeError):
        _ = streamquake.not_a_public_name  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_importing_the_package_is_cheap() -> None:
    code = ("import sys, streamquake; print(sorted(m for m in ('pydantic', 'streamquake.run', "
            "'streamquake.faults', 'pyroute2', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
