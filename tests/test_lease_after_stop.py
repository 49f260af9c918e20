"""Issue 37.5: an apply stretched by a stop past the run's lease is a lapsed lease (exit 5).

The lease is checked before the apply; a SIGSTOP after that check lets the watchdog undo the
run (its journal entries go), and the apply then fails on what the watchdog removed ("removed by
another process", "No such device"). The ledger checks the lease again: LeaseLapsed, not an
InjectorError (exit 3), and the record says the fault was not applied because the lease lapsed.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from streamquake.errors import LeaseLapsed
from streamquake.faults.contract import RunContext
from streamquake.journal import Journal, JournalEntry
from streamquake.run.events import Events
from streamquake.run.lease import RunLease
from streamquake.run.ledger import Ledger, PlannedFault
from streamquake.run.signals import Signals
from tests.example_family import MarkerFileFault
from tests.example_family.injector import MarkerFileInjector


class StoppedThenWatchdog(MarkerFileInjector):
    """The real marker injector, reached only after the watchdog has undone the run: what a
    SIGSTOP between the ledger's lease check and this apply leaves."""

    def apply(self, entry: JournalEntry) -> dict[str, object]:
        path = entry.journal.path
        path.write_text(json.dumps([e for e in json.loads(path.read_text())
                                    if e["id"] != entry.entry_id]))
        return dict(super().apply(entry))


def _ledger(tmp_path: Path) -> tuple[Ledger, Journal]:
    journal = Journal(tmp_path / "journal.json")
    ledger = Ledger(journal, Signals(Events()), Events())
    ledger.lease = RunLease(journal, 30.0, "t")     # not started: only the journal tells
    return ledger, journal


@pytest.mark.timeout(30)
def test_an_apply_that_finds_the_run_undone_is_a_lapsed_lease(tmp_path: Path,
                                                              state_dir: Path) -> None:
    ledger, journal = _ledger(tmp_path)
    spec = MarkerFileFault.model_validate({"type": "marker_file", "name": "flag",
                                           "path": str(tmp_path / "flag")})
    fault = PlannedFault(spec, StoppedThenWatchdog(spec, RunContext("127.0.0.1", 0, tmp_path)),
                         "fault")
    with pytest.raises(LeaseLapsed) as lapsed, contextlib.ExitStack() as stack:
        ledger.apply(stack, fault)
    assert "the watchdog took this run's entries from the journal" in str(lapsed.value)
    assert ledger.records[0].error is not None
    assert ledger.records[0].error.startswith("not applied: the watchdog took"), ledger.records
    assert not (tmp_path / "flag").exists()
    assert journal.records() == []


@pytest.mark.timeout(30)
def test_without_the_stop_the_same_fault_applies(tmp_path: Path, state_dir: Path) -> None:
    ledger, journal = _ledger(tmp_path)
    spec = MarkerFileFault.model_validate({"type": "marker_file", "name": "flag",
                                           "path": str(tmp_path / "flag")})
    fault = PlannedFault(spec, MarkerFileInjector(spec, RunContext("127.0.0.1", 0, tmp_path)),
                         "fault")
    with contextlib.ExitStack() as stack:
        ledger.apply(stack, fault)
        assert (tmp_path / "flag").exists() and len(journal.records()) == 1
    assert ledger.records[0].error is None
    assert not (tmp_path / "flag").exists() and journal.records() == []
