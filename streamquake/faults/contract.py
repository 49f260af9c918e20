"""The fault-family contract: everything the runner knows about faults, and all it may know.

A **family** lives in one folder under ``streamquake/faults/`` and declares itself once, in its
``__init__.py``, as ``FAMILY = Family(...)``: the fault types it offers (each a scenario
``type:``, a pydantic spec model and a lazily imported injector), the run-long resources it
needs (a proxy process, a network namespace, a telemetry sampler) and the faults a scenario
implies without listing them (a network profile). ``catalog.py`` finds families and builds the
scenario's fault union from them. See CREATING_FAULTS.md for a walk-through.

Injector contract (toxiproxy's CREATING_TOXICS.md, in spirit: never drop data on the floor):

* ``apply(entry)`` makes the fault real. First, before it reads any original, it claims what it
  acts on, ``entry.claim({"gpu:<uuid>:power_limit": "the power limit of GPU 0 (...)"})`` (a
  fault of another owner holding one is refused with a sentence; ``per_owner=True`` where the
  family composes one owner's faults on one thing). **Before** each change it calls
  ``entry.save({...})`` with what ``recover`` would need to undo that change from the journal
  alone. It returns a JSON-able dict of what it did, with the system's own read-back where one
  exists.
* ``revert()`` undoes it: idempotent, safe after a partial ``apply``, never raises for "already
  gone"; raises ``RevertError`` only when the fault may still be in place. Returns what it removed.
  It touches only what this fault changed: after a refused claim, nothing.
* Optional: ``preflight()`` (every problem as a sentence, changing nothing), ``describe()`` (the
  configured fault for reports; by default the spec's own fields) and a classmethod
  ``recover(state)`` that undoes a fault from its journal state after a killed run.

The spec modules a family's ``__init__`` imports must stay light (pydantic and the standard
library): ``streamquake validate`` imports every family. Heavy libraries (pyroute2, pynvml,
aiohttp) are imported behind ``FaultType.injector`` and ``Family.resources``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, runtime_checkable

from streamquake.faults.envelope import FaultSpec
from streamquake.journal import Journal, JournalEntry
from streamquake.jsontypes import JsonDict, JsonValue

if TYPE_CHECKING:
    from streamquake.faults.tc.spec import NetworkConfig
    from streamquake.scenario import Scenario


__all__ = [
    "Describes", "Family", "FaultSpec", "FaultType", "Injector", "JsonDict", "JsonValue",
    "Preflights", "Recoverer", "Resource", "RunContext", "Wiring",
]


@dataclass
class Wiring:
    """How the run's parts are connected; resources may change it when they start.

    Resources of stage ``before_target`` may move the embedded target (a namespace sets
    ``target_netns``, ``target_bind_host`` and ``target_cmd_prefix``); ``after_target`` ones may
    put themselves in front of it (a proxy sets ``load_url``, where the load generator sends).
    """

    target_bind_host: str = "127.0.0.1"
    target_cmd_prefix: list[str] = field(default_factory=list)
    target_netns: str | None = None
    target_url: str = ""
    load_url: str = ""


R = TypeVar("R", bound="Resource")


@dataclass
class RunContext:
    """What a fault or resource may know about the run it lives in: typed fields, never a bag.

    ``network`` is the scenario's ``network:`` section (where the target lives, what tc faults
    shape); ``client_netns`` the namespace the load generator sends from (None: ours);
    ``resources`` the run-long parts that are up, found by class with ``find``/``need``.
    """

    target_host: str
    target_port: int
    run_dir: Path
    target_netns: str | None = None
    client_netns: str | None = None
    network: NetworkConfig | None = None
    seed: int = 0
    journal: Journal | None = None
    resources: list[Resource] = field(default_factory=list)

    def find(self, kind: type[R]) -> R | None:
        """The running resource of this class, if the run has one."""
        for r in self.resources:
            if isinstance(r, kind):
                return r
        return None


@runtime_checkable
class Injector(Protocol):
    def apply(self, entry: JournalEntry) -> JsonDict: ...

    def revert(self) -> JsonDict: ...


@runtime_checkable
class Preflights(Protocol):
    def preflight(self) -> list[str]: ...


@runtime_checkable
class Describes(Protocol):
    def describe(self) -> JsonDict: ...


Recoverer = Callable[[dict[str, object]], str]
InjectorFactory = Callable[[FaultSpec, RunContext], Injector]


@runtime_checkable
class Resource(Protocol):
    """A run-long part a family needs: started before any fault, stopped after every revert.

    ``key`` names it in the report (``telemetry.<key>``) and dedupes it when several faults of a
    family ask for the same one; ``title`` names it for people. ``stop`` is idempotent and must
    not raise for "already gone".
    """

    key: str
    title: str
    stage: Literal["before_target", "after_target"]

    def start(self, ctx: RunContext, wiring: Wiring) -> None: ...

    def stop(self) -> None: ...

    def report(self) -> JsonDict | None: ...


@dataclass(frozen=True)
class FaultType:
    """One scenario ``type:``: its spec model and, imported only when a run needs it, its
    injector class (called as ``injector(spec, ctx)``)."""

    name: str
    spec: type[FaultSpec]
    injector: Callable[[], InjectorFactory]
    summary: str = ""
    # For `run --dry-run`: where this fault would act, in words, from the scenario alone.
    where: Callable[[FaultSpec, Scenario], str] | None = None
    # For `inject`: why this fault, as configured, needs the target's address (--target),
    # with what to give; None when it does not.
    needs_target: Callable[[FaultSpec], str | None] | None = None


def _none(scenario: Scenario) -> Sequence[Resource]:
    return ()


def _no_faults(scenario: Scenario) -> Sequence[FaultSpec]:
    return ()


@dataclass(frozen=True)
class Family:
    """A family of faults, declared once in ``faults/<family>/__init__.py`` as ``FAMILY``.

    ``resources(scenario)`` returns the run-long parts this scenario needs from the family
    (called for every scenario, whether or not it lists the family's faults: a namespace or GPU
    telemetry may be wanted anyway). ``implied(scenario)`` returns faults the scenario implies
    for the whole run. ``recoverers`` maps journal entry types that are not fault types (a
    namespace, say) to what undoes them after a killed run.
    """

    name: str
    faults: Sequence[FaultType]
    resources: Callable[[Scenario], Sequence[Resource]] = _none
    implied: Callable[[Scenario], Sequence[FaultSpec]] = _no_faults
    recoverers: Mapping[str, Callable[[], Recoverer]] = field(default_factory=dict)
