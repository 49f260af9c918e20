"""An example fault family, kept in the tests to prove CREATING_FAULTS.md: one folder, found by
the catalog (here through $STREAMQUAKE_FAULT_FAMILIES=tests.example_family), validated, run and
recovered through the CLI like the built-in ones.

``marker_file`` puts a file in place for its phase and removes it after: a fault whose effect
anyone can see, and which outlives a killed run, so `streamquake recover` must undo it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import field_validator

from streamquake.faults.contract import Family, FaultType, InjectorFactory, Resource
from streamquake.faults.envelope import FaultSpec

if TYPE_CHECKING:
    from streamquake.scenario import Scenario


class MarkerFileFault(FaultSpec):
    """``{type: marker_file, path: /tmp/x/flag, content: "on"}``."""

    type: Literal["marker_file"] = "marker_file"
    path: str
    content: str = "fault on"

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path, e.g. /tmp/streamquake-flag")
        return v


def _injector() -> InjectorFactory:
    from tests.example_family.injector import MarkerFileInjector

    return MarkerFileInjector


def _resources(scenario: Scenario) -> Sequence[Resource]:
    if not any(f.type == "marker_file" for f in scenario.faults):
        return ()
    from tests.example_family.injector import Stopwatch

    return (Stopwatch(),)


FAMILY = Family(
    name="example",
    faults=(FaultType("marker_file", MarkerFileFault, _injector, "a file in place for a phase"),),
    resources=_resources,
)
