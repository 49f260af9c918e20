"""An example fault family, kept in the tests to prove CREATING_FAULTS.md: one folder, found by
the catalog (here through $STREAMQUAKE_FAULT_FAMILIES=tests.example_family), validated, run and
recovered through the CLI like the built-in ones.

``marker_file`` puts a file in place for its phase and removes it after: a fault whose effect
anyone can see, and which outlives a killed run, so `streamquake recover` must undo it. An
agent may be told where it may put them (``streamquake agent --allow-dirs DIR``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Literal

from pydantic import Field, field_validator

from streamquake.faults.contract import (
    AgentAbility,
    AllowOption,
    Allows,
    Family,
    FaultSpec,
    FaultType,
    HoldRequest,
    InjectorFactory,
    Resource,
    ScenarioView,
)


class MarkerFileFault(FaultSpec):
    """``{type: marker_file, path: /tmp/x/flag, content: "on"}``."""

    type: Literal["marker_file"] = "marker_file"
    path: str
    content: str = "fault on"
    mode: str = Field("644", pattern=r"^[0-7]{3,4}$", description="the file's permissions, in "
                      "octal (as chmod takes them)")

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path, e.g. /tmp/streamquake-flag")
        return v


def _injector() -> InjectorFactory[MarkerFileFault]:
    from tests.example_family.injector import MarkerFileInjector

    return MarkerFileInjector


def _resources(scenario: ScenarioView) -> Sequence[Resource]:
    if not any(f.type == "marker_file" for f in scenario.faults):
        return ()
    from tests.example_family.injector import Stopwatch

    return (Stopwatch(),)


def _refusal(spec: FaultSpec, allows: Allows, request: HoldRequest) -> str | None:
    dirs = allows.get("dirs")
    if not isinstance(spec, MarkerFileFault) or dirs is None:
        return None
    if any(PurePath(os.path.normpath(spec.path)).is_relative_to(d) for d in dirs):
        return None
    return (f"this agent may not put a marker at {spec.path}; it may put them only under "
            f"{', '.join(sorted(dirs))} (its --allow-dirs)")


def _absolute(text: str) -> str:
    if not os.path.isabs(text):
        raise ValueError(f"{text} is not an absolute directory")
    return os.path.normpath(text)


def _capabilities() -> Mapping[str, bool]:
    return {"tmp_writable": os.access("/tmp", os.W_OK)}


FAMILY = Family(
    name="example",
    faults=(FaultType[MarkerFileFault]("marker_file", MarkerFileFault, _injector,
                                       "a file in place for a phase"),),
    resources=_resources,
    agent=AgentAbility(
        options=(AllowOption("dirs", "Directories marker_file faults may write in (default: "
                             "any).", "marker directories", _absolute),),
        refusal=_refusal, capabilities=_capabilities),
)
