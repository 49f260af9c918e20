"""What an agent may touch: fault types, and what each family's allowlist options allow
(``--allow-interfaces`` for tc faults, ``--allow-gpus``, ``--allow-proxies``...; the families
declare them, see ``AgentAbility`` in faults/contract.py).

Each refusal is a sentence that says what is allowed, so the person at the controller can fix
the scenario without reading the agent's configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from streamquake.agentwire.api import Allowed
from streamquake.faults.catalog import allow_options, family_of
from streamquake.faults.contract import Allows, FaultSpec, HoldRequest


def _split(values: Iterable[str] | None) -> frozenset[str] | None:
    """``["a,b", "c"]`` -> {a, b, c}; None or nothing given: no restriction."""
    if not values:
        return None
    out = {v.strip() for raw in values for v in raw.split(",") if v.strip()}
    return frozenset(out) or None


@dataclass(frozen=True)
class Allowlist:
    types: frozenset[str]
    # By AllowOption.name (interfaces, gpus, proxies...); None or absent: anything.
    options: Allows = field(default_factory=dict)

    @classmethod
    def build(cls, known_types: Iterable[str], types: Iterable[str] | None = None,
              options: Mapping[str, Iterable[str] | None] | None = None) -> Allowlist:
        """``options``: the values given for each family's ``--allow-<name>``. Raises
        ValueError for a type no family offers here (a typo would allow nothing), or a value
        its family cannot read."""
        known = frozenset(known_types)
        wanted = _split(types)
        if wanted is not None and wanted - known:
            unknown = ", ".join(sorted(wanted - known))
            raise ValueError(f"--allow-types names fault types this agent does not have: "
                             f"{unknown}; known: {', '.join(sorted(known))}")
        given = options or {}
        values: dict[str, frozenset[str] | None] = {}
        for option in allow_options():
            listed = _split(given.get(option.name))
            try:
                if listed is not None and option.normalise is not None:
                    listed = frozenset(option.normalise(v) for v in listed)
            except ValueError as exc:
                raise ValueError(f"--allow-{option.name}: {exc}") from None
            values[option.name] = listed
        return cls(types=wanted if wanted is not None else known, options=values)

    def view(self) -> Allowed:
        return Allowed(types=sorted(self.types), **{
            name: None if v is None else sorted(v) for name, v in self.options.items()})

    def type_refusal(self, type_name: str) -> str | None:
        if type_name in self.types:
            return None
        return (f"this agent does not allow {type_name} faults; it allows: "
                f"{', '.join(sorted(self.types)) or 'none'}")

    def refusal(self, spec: FaultSpec, request: HoldRequest) -> str | None:
        """Why this agent must not apply ``spec`` (None: it may), as its family judges it."""
        return (self.type_refusal(spec.type)
                or family_of(spec.type).agent.refusal(spec, self.options, request))
