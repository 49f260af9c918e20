"""The fault-family contract: everything the runner knows about faults, and all it may know.

A **family** lives in one folder under ``streamquake/faults/`` and declares itself once, in its
``__init__.py``, as ``FAMILY = Family(...)``: the fault types it offers (each a scenario
``type:``, a pydantic spec model and a lazily imported injector), the run-long resources it
needs (a proxy process, a network namespace, a telemetry sampler) and the faults a scenario
implies without listing them (a network profile), and what an agent may be told to allow of it
(``AgentAbility``). Families read a scenario only through ``ScenarioView``, never importing it.
``catalog.py`` finds families and builds the scenario's fault union from them. See
CREATING_FAULTS.md for a walk-through.

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
* Optional, each a protocol here: ``preflight()`` (``Preflights``: every problem as a sentence,
  changing nothing), ``describe()`` (``Describes``: the configured fault for reports; by default
  the spec's own fields) and a classmethod ``recover(state)`` (``Recovers``) that undoes a fault
  from its journal state after a killed run.

The spec modules a family's ``__init__`` imports must stay light (pydantic and the standard
library): ``streamquake validate`` imports every family. Heavy libraries (pyroute2, pynvml,
aiohttp) are imported behind ``FaultType.injector`` and ``Family.resources``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

from streamquake.errors import InjectorError, PreflightError, RevertError
from streamquake.faults.envelope import FaultSpec
from streamquake.journal import Journal, JournalEntry
from streamquake.jsontypes import JsonDict, JsonValue

__all__ = [
    "AgentAbility", "AllowOption", "Allows", "Describes", "EndsByItself", "Family", "FaultSpec",
    "FaultType",
    "HoldRequest", "Injector", "InjectorError", "InjectorFactory", "Journal", "JournalEntry",
    "JsonDict", "JsonValue", "NetworkView", "PreflightError", "Preflights", "Recoverer",
    "Recovers", "Resource", "RevertError", "RunContext", "RunningStanding", "ScenarioView",
    "Standing", "TargetView", "TelemetryChart", "Wiring", "charted",
]


class NetworkView(Protocol):
    """The scenario's ``network:`` section as families read it (the scenario schema owns the
    model): where the target lives and where tc faults land by default."""

    @property
    def mode(self) -> Literal["host", "namespace"]: ...

    @property
    def interface(self) -> str | None: ...

    @property
    def scope(self) -> Literal["target", "interface"]: ...

    @property
    def direction(self) -> Literal["egress", "both"]: ...

    @property
    def profile(self) -> str | None: ...


class TargetView(Protocol):
    """The scenario's ``target:`` as families read it."""

    @property
    def embedded(self) -> object | None: ...   # None: a ``url`` target, not the embedded one

    @property
    def verify_tls(self) -> bool: ...

    # What the scenario's own requests are (a fault that sends requests of its own asks alike).
    @property
    def protocol(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def path(self) -> str | None: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


class ScenarioView(Protocol):
    """All a family may read of a scenario: the scenario satisfies it, and no family imports
    the scenario (its schema unions the families' specs)."""

    @property
    def target(self) -> TargetView: ...

    @property
    def network(self) -> NetworkView: ...

    @property
    def faults(self) -> Sequence[FaultSpec]: ...


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


_R = TypeVar("_R", bound="Resource")


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
    network: NetworkView | None = None
    seed: int = 0
    journal: Journal | None = None
    resources: list[Resource] = field(default_factory=list)

    def find(self, kind: type[_R]) -> _R | None:
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
class EndsByItself(Protocol):
    """An injector whose fault can end with no revert: the part it acts in went away (a
    standing proxy stopped with Ctrl-C takes its faults with it). ``ended`` says how in a
    sentence, or None while the fault stands or nothing can tell; it may ask over the network,
    within a few seconds. An agent holding the fault asks now and then, and ends the hold."""

    def ended(self) -> str | None: ...


@runtime_checkable
class Preflights(Protocol):
    def preflight(self) -> list[str]: ...


@runtime_checkable
class Describes(Protocol):
    def describe(self) -> JsonDict: ...


class Recoverer(Protocol):
    """What undoes a journal entry after a killed run, from its saved state alone; says what it
    did in a sentence."""

    def __call__(self, state: dict[str, object], /) -> str: ...


@runtime_checkable
class Recovers(Protocol):
    """An injector class that can undo its fault from the journal (a classmethod ``recover``)."""

    def recover(self, state: dict[str, object], /) -> str: ...


_S = TypeVar("_S", bound=FaultSpec)
_S_co = TypeVar("_S_co", bound=FaultSpec, covariant=True)
_S_contra = TypeVar("_S_contra", bound=FaultSpec, contravariant=True)


class InjectorFactory(Protocol[_S_contra]):
    """An injector class, called as ``injector(spec, ctx)``."""

    def __call__(self, spec: _S_contra, ctx: RunContext, /) -> Injector: ...


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
class TelemetryChart:
    """One chart report.html draws of a resource's telemetry: ``field`` of each sample over the
    run's time (``t``, wall clock), one line per ``series_by`` value."""

    field: str
    title: str
    unit: str


def charted(samples: Sequence[JsonDict], heading: str, caption: str,
            charts: Sequence[TelemetryChart], series_by: str | None = None,
            series_label: str = "") -> JsonDict:
    """A resource's ``report()`` of samples that report.html charts (any family's, under
    ``telemetry.<key>``): ``samples`` each with ``t`` (epoch seconds) and the charts' fields;
    ``series_by`` the field that tells one line from another (a GPU's index), shown as
    ``series_label`` and its value ("GPU 0")."""
    return {"samples": list(samples), "chart": {
        "heading": heading, "caption": caption, "series_by": series_by,
        "series_label": series_label,
        "charts": [{"field": c.field, "title": c.title, "unit": c.unit} for c in charts]}}


@dataclass(frozen=True)
class FaultType(Generic[_S_co]):
    """One scenario ``type:``: its spec model and, imported only when a run needs it, its
    injector class (called as ``injector(spec, ctx)``). The catalog hands each function only
    specs of this type's ``spec``."""

    name: str
    spec: type[_S_co]
    injector: Callable[[], InjectorFactory[_S_co]]
    summary: str = ""
    # For `run --dry-run`: where this fault would act, in words, from the scenario alone.
    where: Callable[[_S_co, ScenarioView], str] | None = None
    # For `inject`: why this fault, as configured, needs the target's address (--target),
    # with what to give; None when it does not.
    needs_target: Callable[[_S_co], str | None] | None = None


Allows = Mapping[str, frozenset[str] | None]
"""An agent's allowlist values by ``AllowOption.name`` (None: that option was not given, so
anything)."""


@dataclass(frozen=True)
class HoldRequest:
    """What a controller's request to an agent says around the fault: the network section it
    runs under and the standing resource (its control URL, e.g. a standing SSE proxy's) the
    fault would go into."""

    network: NetworkView | None = None
    standing: str | None = None


@dataclass(frozen=True)
class RunningStanding:
    """A standing resource that runs on this host: its address, what it stands in front of,
    and its control URL."""

    address: str
    upstream: str
    control_url: str


def _nothing_runs() -> Sequence[RunningStanding]:
    return ()


@dataclass(frozen=True)
class Standing:
    """A resource of a family's that a person starts and keeps up through a game day (the SSE
    proxy's ``streamquake proxy``), which the family's hand-held faults go into: ``inject``'s
    ``--proxy HOST:PORT`` names one, the agent's request carries its control URL, and the
    injector finds it among the run's resources as ``attach(control_url)``.

    ``what`` names it in sentences ("standing SSE proxy", ``plural`` "standing SSE proxies");
    ``types`` the fault types that go
    into one; ``control_url(text)`` turns what a person writes into its control URL (a
    ValueError is a sentence); ``address(control_url)`` is how output names it; ``running()``
    lists those up on this host; ``start_hint`` is the command that starts one.
    """

    what: str
    plural: str
    types: frozenset[str]
    control_url: Callable[[str], str]
    address: Callable[[str], str]
    attach: Callable[[str], Resource]
    start_hint: str
    running: Callable[[], Sequence[RunningStanding]] = _nothing_runs


@dataclass(frozen=True)
class AllowOption:
    """An allowlist option of ``streamquake agent``: ``--allow-<name> V[,V..]``, repeatable;
    not given, anything. Its values show as ``allow.<name>`` in the agent's ``/v1/info``."""

    name: str
    help: str
    # How the agent's start-up line names the values ("GPUs any; SSE proxies 10.0.0.5:9000").
    title: str
    # Each value as the refusal compares it; a ValueError is a sentence for the operator.
    normalise: Callable[[str], str] | None = None

    def __post_init__(self) -> None:
        if not (self.name.isidentifier() and self.name.islower()):
            raise ValueError(f"an allowlist option is named by a lowercase word (--allow-gpus), "
                             f"not {self.name!r}")


def _anything(spec: FaultSpec, allows: Allows, request: HoldRequest) -> str | None:
    return None


def _no_capabilities() -> Mapping[str, bool]:
    return {}


@dataclass(frozen=True)
class AgentAbility:
    """What an agent may allow of a family, so an agent holds its faults knowing only this.

    ``options`` extend the agent's command line; ``refusal(spec, allows, request)`` says why
    the agent must not apply ``spec`` (of this family) under ``allows`` (None: it may), in a
    sentence that names what is allowed; ``capabilities()`` what the agent reports of its host
    for this family (``cap_net_admin``, ``nvml``), cheap and never raising.
    """

    options: Sequence[AllowOption] = ()
    refusal: Callable[[FaultSpec, Allows, HoldRequest], str | None] = _anything
    capabilities: Callable[[], Mapping[str, bool]] = _no_capabilities


def _none(scenario: ScenarioView) -> Sequence[Resource]:
    return ()


def _no_faults(scenario: ScenarioView) -> Sequence[FaultSpec]:
    return ()


@dataclass(frozen=True)
class Family:
    """A family of faults, declared once in ``faults/<family>/__init__.py`` as ``FAMILY``.

    ``resources(scenario)`` returns the run-long parts this scenario needs from the family
    (called for every scenario, whether or not it lists the family's faults: a namespace or GPU
    telemetry may be wanted anyway). ``implied(scenario)`` returns faults the scenario implies
    for the whole run. ``recoverers`` maps journal entry types that are not fault types (a
    namespace, say) to what undoes them after a killed run. ``agent``: what an agent may be told
    to allow of it (any agent holds any family's faults; this narrows what it accepts).
    ``standing``: the resource a person keeps up that its hand-held faults go into, if any.
    ``network_profiles``: the names ``network.profile`` may take, where the family applies them.
    """

    name: str
    faults: Sequence[FaultType[FaultSpec]]
    resources: Callable[[ScenarioView], Sequence[Resource]] = _none
    implied: Callable[[ScenarioView], Sequence[FaultSpec]] = _no_faults
    recoverers: Mapping[str, Callable[[], Recoverer]] = field(default_factory=dict)
    agent: AgentAbility = AgentAbility()
    standing: Standing | None = None
    # The named network profiles (``network.profile``) the family applies for a whole run.
    network_profiles: Callable[[], Sequence[str]] | None = None
