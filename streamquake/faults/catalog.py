"""Where fault families are found: every package under ``streamquake/faults/`` that declares
``FAMILY``, then the modules named in ``$STREAMQUAKE_FAULT_FAMILIES`` (comma-separated, for a
family kept outside this tree), then the ``streamquake.faults`` entry points of installed
packages. Only the families' light ``__init__`` modules are imported here.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from collections.abc import Iterator
from importlib.metadata import entry_points

from streamquake.errors import StreamquakeError
from streamquake.faults.contract import (
    AllowOption,
    Family,
    FaultSpec,
    FaultType,
    Recoverer,
    Recovers,
    Standing,
)

FAMILIES_ENV = "STREAMQUAKE_FAULT_FAMILIES"
ENTRY_POINT_GROUP = "streamquake.faults"


def _module_names() -> Iterator[str]:
    import streamquake.faults as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.ispkg:
            yield f"{pkg.__name__}.{info.name}"
    for name in os.environ.get(FAMILIES_ENV, "").split(","):
        if name.strip():
            yield name.strip()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        yield ep.value.split(":")[0]


@functools.cache
def families() -> tuple[Family, ...]:
    found: list[Family] = []
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise StreamquakeError(
                f"cannot import fault family module {name!r} ({exc}); check "
                f"${FAMILIES_ENV} and the installed plugins"
            ) from exc
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family) and family not in found:
            found.append(family)
    types = [t.name for f in found for t in f.faults]
    dupes = sorted({t for t in types if types.count(t) > 1})
    if dupes:
        raise StreamquakeError(f"two fault families declare the same type: {', '.join(dupes)}")
    options = [o.name for f in found for o in f.agent.options]
    dupes = sorted({o for o in options if options.count(o) > 1 or o == "types"})
    if dupes:
        raise StreamquakeError("two fault families declare the same agent allowlist option: "
                               f"{', '.join(f'--allow-{o}' for o in dupes)}")
    return tuple(found)


def fault_types() -> dict[str, FaultType[FaultSpec]]:
    """Every fault type by name, sorted, so messages that list them read the same everywhere."""
    return dict(sorted((t.name, t) for f in families() for t in f.faults))


def family_of(type_name: str) -> Family:
    """The family that offers this fault type."""
    fault_type(type_name)
    return next(f for f in families() if any(t.name == type_name for t in f.faults))


def allow_options() -> list[AllowOption]:
    """Every family's agent allowlist options (``--allow-<name>``), in family order."""
    return [o for f in families() for o in f.agent.options]


def fault_type(name: str) -> FaultType[FaultSpec]:
    try:
        return fault_types()[name]
    except KeyError:
        raise StreamquakeError(
            f"no fault family offers type {name!r}; known: {', '.join(sorted(fault_types()))}"
        ) from None


def resource_journal_types() -> set[str]:
    """Journal entry types that belong to run-long resources (a namespace), not to faults."""
    return {t for f in families() for t in f.recoverers}


def recoverer(entry_type: str) -> Recoverer:
    """What undoes a journal entry of this type after a killed run."""
    for family in families():
        if entry_type in family.recoverers:
            return family.recoverers[entry_type]()
    factory = fault_type(entry_type).injector()
    if not isinstance(factory, Recovers):
        raise StreamquakeError(f"fault type {entry_type!r} cannot be recovered from the journal")
    return factory.recover


def standing_for(type_name: str) -> Standing | None:
    """The standing resource faults of this type go into (None: they go into none)."""
    return family_of(type_name).standing


def standings() -> list[Standing]:
    """Every family's standing resource, in family order."""
    return [f.standing for f in families() if f.standing is not None]


def check_network_profile(name: str) -> None:
    """Raise ValueError with a sentence unless a family offers the network profile ``name``."""
    known = sorted(p for f in families() if f.network_profiles for p in f.network_profiles())
    if name not in known:
        raise ValueError(f"unknown network profile {name!r}; known profiles: {', '.join(known)}")
