"""``streamquake recover``: undo what the journal says a killed run left behind.

Only orphans (entries whose owner is gone) are undone: the journal is shared by every run on the
host, and removing a live run's fault would change its experiment mid-phase.
"""

from __future__ import annotations

from datetime import datetime

from streamquake.errors import InjectorError
from streamquake.faults import agent_lease, catalog
from streamquake.faults.contract import Recoverer
from streamquake.journal import Claims, Journal, JournalRecord

CHECK_BY_HAND = "tc qdisc show, ip netns list, nvidia-smi -q -d CLOCK"


def _recoverer(entry_type: str) -> Recoverer:
    """What undoes an entry of ``entry_type`` from its state alone: the fault catalog knows,
    except for faults held by an agent (any type may be)."""
    if entry_type == agent_lease.JOURNAL_TYPE:
        return agent_lease.recover_lease
    return catalog.recoverer(entry_type)


def _resource_last(rec: JournalRecord) -> bool:
    # Faults first, then what they were applied in (a namespace and its links).
    return (rec.type == agent_lease.JOURNAL_TYPE
            or rec.type in catalog.resource_journal_types())


def _skipped(rec: JournalRecord) -> str:
    started = rec.owner_started_at
    when = "start time unknown"
    if started is not None:
        at = datetime.fromtimestamp(started).astimezone()
        when = f"started {at.isoformat(timespec='seconds')}"
    return (f"skipped {rec.name} ({rec.type}): owned by the running process {rec.pid} ({when}), "
            "still in use; stop that run first")


def recover_all(journal: Journal | None = None) -> tuple[list[str], bool]:
    """Revert every orphaned fault, idempotently. Returns (lines to print, any failed).

    Entries of live runs are left alone and listed as skipped, which is not a failure.
    """
    journal = journal or Journal()
    records = journal.records()
    # After the read: reading is what moves a damaged file aside.
    lines = [f"WARNING: the journal {journal.path} was damaged and moved to {aside}; faults it "
             f"listed may still be in place: check by hand ({CHECK_BY_HAND})"
             for aside in journal.damaged]
    failed = bool(lines)
    live = [r for r in records if r.owner_alive]
    orphans = [r for r in records if not r.owner_alive]
    said, failed_now = _revert_records(journal, orphans)
    lines += said
    lines.extend(_skipped(r) for r in live)
    # Claims left by a holder killed between undoing its fault and freeing them: nothing holds
    # them, but every later fault on the same thing would be refused until they go.
    try:
        freed = Claims().prune()
    except InjectorError as exc:
        lines.append(f"FAILED to check the fault claims: {exc}")
        return lines, True
    lines.extend(f"freed the claim on {what}: no journal entry holds it (its fault is undone)"
                 for what in freed)
    if not lines:
        return [f"nothing to recover: the journal {journal.path} lists no applied fault"], False
    return lines, failed or failed_now


def _revert_records(journal: Journal, records: list[JournalRecord]) -> tuple[list[str], bool]:
    """Undo each record from its state alone, faults before the resources they live in."""
    lines: list[str] = []
    failed = False
    for rec in sorted(records, key=_resource_last):
        label = f"{rec.name} ({rec.type}, applied by pid {rec.pid})"
        try:
            said = _recoverer(rec.type)(dict(rec.state))
        except Exception as exc:  # noqa: BLE001 - keep going; the entry stays for a retry
            failed = True
            lines.append(f"FAILED {label}: {exc}")
            continue
        journal.remove(rec.id)
        lines.append(f"recovered {label}: {said}")
    return lines, failed


def recover_owner(journal: Journal, pid: int, pid_start: int | None) -> tuple[list[str], bool]:
    """Revert every entry one process owns, alive or not: what the local watchdog does when
    that run's lease lapses (the run was killed, stopped or starved past its lease). A run that
    wakes afterwards finds its entries gone and says its phase was not faulted throughout."""
    mine = [r for r in journal.records() if r.pid == pid and r.pid_start == pid_start]
    return _revert_records(journal, mine)
