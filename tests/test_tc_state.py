"""The tc hop state keeps the journal's JSON format: entries written by earlier versions (these
literals are the shapes the dict-based code wrote) are read back unchanged, and damaged ones are
refused with a sentence rather than a KeyError, so `recover` can report them."""

from __future__ import annotations

import pytest

from streamquake.faults.tc.state import HopState, hops_from_json

BARE = {"netns": None, "ifname": "sqh1a2b3c4d", "match": "to_target", "via_ifb": False}
HTB = {**BARE, "class_minor": 16, "leaf_majors": [21250], "prefs": [21248, 21249]}
IFB = {"netns": "sq-1a2b3c4d", "ifname": "sqt1a2b3c4d", "match": "from_target",
       "via_ifb": True, "ingress_owned": True, "ifb": "sqifb1a2b3c",
       "leaf_majors": [21251], "ingress_prefs": [21300]}
# A fault on a run's scaffold holds only its leaves (the class, filters and ifb are the
# scaffold's own entry): written since the scaffold, with leaf_only.
LEAF_HTB = {**BARE, "class_minor": 16, "leaf_majors": [21503], "prefs": [], "leaf_only": True}
LEAF_IFB = {**IFB, "ingress_owned": False, "leaf_majors": [21502], "ingress_prefs": [],
            "leaf_only": True}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("written", [BARE, HTB, IFB, LEAF_HTB, LEAF_IFB],
                         ids=["bare", "htb", "ifb", "leaf-htb", "leaf-ifb"])
def test_journal_hops_of_every_shape_round_trip(written: dict[str, object]) -> None:
    hop = HopState.from_json(written)
    assert hop.to_json() == written
    assert [h.to_json() for h in hops_from_json([written, written])] == [written, written]


@pytest.mark.timeout(10)
def test_a_damaged_hop_is_refused_with_a_sentence() -> None:
    assert hops_from_json(None) == []
    with pytest.raises(ValueError, match="match is 'sideways'"):
        HopState.from_json({**HTB, "match": "sideways"})
    with pytest.raises(ValueError, match="ifname is None"):
        HopState.from_json({**HTB, "ifname": None})
    with pytest.raises(ValueError, match="not a list of hops"):
        hops_from_json({"ifname": "x"})
