"""The injector contract. Every fault type is one file implementing this.

Contract (read before writing an injector):

* ``preflight()`` checks capabilities without changing anything and returns every problem as a
  sentence a user can act on (empty list = ready).
* ``apply(entry)`` makes the fault real. **Before** each change it calls ``entry.save({...})``
  with whatever ``recover`` would need to undo that change from the journal alone (interface,
  handle, namespace, original GPU clocks...). It returns a JSON-able dict of what it did,
  including the system's own read-back where one exists (kernel qdisc dump, NVML clocks).
* ``revert()`` undoes it. Idempotent, safe after a partial ``apply``, and never raises for
  "already gone". Raises ``RevertError`` only when the fault may still be in place. Returns a
  JSON-able dict of what it removed.
* ``describe()`` returns the configured fault as a JSON-able dict, for reports.
* ``recover(state)`` (classmethod) undoes a fault from its journal state alone, idempotently,
  for ``streamquake recover`` after a killed run, and returns one sentence of what it did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from streamquake.journal import JournalEntry


@dataclass(frozen=True)
class RunContext:
    """What an injector may know about the run it lives in."""

    target_host: str
    target_port: int
    run_dir: Path
    proxy_control_url: str | None = None
    target_netns: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Injector(Protocol):
    type_name: ClassVar[str]

    def preflight(self) -> list[str]: ...

    def apply(self, entry: JournalEntry) -> dict[str, Any]: ...

    def revert(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...

    @classmethod
    def recover(cls, state: dict[str, Any]) -> str: ...


InjectorFactory = Callable[[Any, RunContext], Injector]

_REGISTRY: dict[str, type] = {}


def register(type_name: str) -> Callable[[type], type]:
    """Class decorator: make an injector known by its scenario ``type``."""

    def deco(cls: type) -> type:
        cls.type_name = type_name  # type: ignore[attr-defined]
        _REGISTRY[type_name] = cls
        return cls

    return deco


def injector_class(type_name: str) -> type:
    _load_builtin_injectors()
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise KeyError(f"no injector registered for fault type {type_name!r}") from None


def registered_types() -> list[str]:
    _load_builtin_injectors()
    return sorted(_REGISTRY)


def _load_builtin_injectors() -> None:
    # Imported lazily so that importing streamquake never touches netlink or NVML.
    import importlib

    for mod in ("sse_proxy", "netem", "tbf", "gpu_clocks"):
        try:
            importlib.import_module(f"streamquake.injectors.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"streamquake.injectors.{mod}":
                raise
