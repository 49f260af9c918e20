"""``streamquake recover``: undo what the journal says a killed run left behind."""

from __future__ import annotations

from typing import Any

from streamquake.injectors.base import injector_class
from streamquake.journal import Journal
from streamquake.netns import TOPOLOGY_JOURNAL_TYPE, NamespaceTopology


def recover_all(journal: Journal | None = None) -> tuple[list[str], bool]:
    """Revert every journalled fault, idempotently. Returns (lines to print, any failed)."""
    journal = journal or Journal()
    entries = journal.entries()
    if not entries:
        return [f"nothing to recover: the journal {journal.path} lists no applied fault"], False
    lines, failed = [], False
    # Faults first, then the namespaces and links they were applied in.
    for entry in sorted(entries, key=lambda e: e["type"] == TOPOLOGY_JOURNAL_TYPE):
        label = f"{entry['name']} ({entry['type']}, applied by pid {entry['pid']})"
        try:
            cls: Any = (NamespaceTopology if entry["type"] == TOPOLOGY_JOURNAL_TYPE
                        else injector_class(entry["type"]))
            said = cls.recover(entry.get("state", {}))
        except Exception as exc:  # noqa: BLE001 - keep going; the entry stays for a retry
            failed = True
            lines.append(f"FAILED {label}: {exc}")
            continue
        journal.remove(entry["id"])
        lines.append(f"recovered {label}: {said}")
    return lines, failed
