"""What a tc fault holds on one hop, as the journal keeps it: enough for ``remove`` to undo it
from the journal alone, after a killed run (``ScopedTc.recover``).

The JSON is the journal's format: its keys and value shapes are those of every earlier version,
so a fault applied before an upgrade is still recovered after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeGuard, get_args

from streamquake.faults.tc.placement import Hop, Match
from streamquake.jsontypes import JsonDict

_MATCHES: tuple[str, ...] = get_args(Match)


@dataclass(frozen=True, slots=True)
class HopState:
    """One hop (``netns``, ``ifname``, ``match``, ``via_ifb``: where) and what we took on it.

    A hop is first kept bare, then, before anything changes, with what was planned: on an htb
    hop our shaped class (``class_minor`` under 5351:), the leaf qdiscs' majors and the u32
    filter prefs; on an ifb hop (``via_ifb``) the ifb device, the leaf majors (on the ifb), the
    ingress filter prefs and whether the ingress qdisc is ours to remove. ``leaf_only``: the
    class, filters and ifb belong to the run's scaffold (``scaffold``); this fault holds only its
    leaf qdiscs under that class (or at the ifb's root), and removing it removes only those.
    """

    netns: str | None
    ifname: str
    match: Match
    via_ifb: bool = False
    class_minor: int | None = None
    leaf_majors: tuple[int, ...] = ()
    prefs: tuple[int, ...] = ()
    ifb: str | None = None
    ingress_owned: bool = False
    ingress_prefs: tuple[int, ...] = ()
    leaf_only: bool = False

    @classmethod
    def bare(cls, hop: Hop) -> HopState:
        """The hop before anything is planned on it."""
        return cls(hop.netns, hop.ifname, hop.match, hop.via_ifb)

    def to_json(self) -> JsonDict:
        out: JsonDict = {"netns": self.netns, "ifname": self.ifname, "match": self.match,
                         "via_ifb": self.via_ifb}
        if self.via_ifb and self.ifb is not None:
            out.update({"ingress_owned": self.ingress_owned, "ifb": self.ifb,
                        "leaf_majors": list(self.leaf_majors),
                        "ingress_prefs": list(self.ingress_prefs)})
        elif not self.via_ifb and self.class_minor is not None:
            out.update({"class_minor": self.class_minor, "leaf_majors": list(self.leaf_majors),
                        "prefs": list(self.prefs)})
        if self.leaf_only:
            out["leaf_only"] = True
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> HopState:
        """A hop from the journal (any version); keys a bare hop lacks take their defaults.

        Raises ValueError for a value of the wrong shape, naming it.
        """
        match = raw.get("match")
        if not _is_match(match):
            raise _bad("match", match, f"one of {', '.join(_MATCHES)}")
        return cls(
            netns=_opt_str(raw, "netns"),
            ifname=_str(raw, "ifname"),
            match=match,
            via_ifb=_bool(raw, "via_ifb"),
            class_minor=_opt_int(raw, "class_minor"),
            leaf_majors=_ints(raw, "leaf_majors"),
            prefs=_ints(raw, "prefs"),
            ifb=_opt_str(raw, "ifb"),
            ingress_owned=_bool(raw, "ingress_owned"),
            ingress_prefs=_ints(raw, "ingress_prefs"),
            leaf_only=_bool(raw, "leaf_only"),
        )


def hops_from_json(value: object) -> list[HopState]:
    """The ``hops`` of a tc fault's journal state (absent: none)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(h, dict) for h in value):
        raise ValueError(f"journal state: hops is {value!r}, not a list of hops")
    return [HopState.from_json(h) for h in value]


def _is_match(value: object) -> TypeGuard[Match]:
    return value in _MATCHES


def _bad(key: str, value: object, want: str) -> ValueError:
    return ValueError(f"journal hop state: {key} is {value!r}, not {want}")


def _str(raw: Mapping[str, object], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise _bad(key, value, "a string")
    return value


def _opt_str(raw: Mapping[str, object], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(key, value, "a string or null")
    return value


def _bool(raw: Mapping[str, object], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def _opt_int(raw: Mapping[str, object], key: str) -> int | None:
    value = raw.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(key, value, "an integer")
    return value


def _ints(raw: Mapping[str, object], key: str) -> tuple[int, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _bad(key, value, "a list of integers")
    return tuple(value)
