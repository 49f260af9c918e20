"""An on-disk record of every fault applied and not yet reverted.

Written *before* a fault changes anything, so that a process killed mid-fault leaves enough
behind for ``streamquake recover`` (or the next ``run``'s refusal to start) to undo it.

Location: ``$STREAMQUAKE_STATE_DIR/journal.json`` if set, else
``$XDG_STATE_HOME/streamquake/journal.json`` (``~/.local/state/streamquake/journal.json``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def state_dir() -> Path:
    explicit = os.environ.get("STREAMQUAKE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "streamquake"


def journal_path() -> Path:
    return state_dir() / "journal.json"


@dataclass
class JournalEntry:
    """A live handle on one fault's record; ``save`` persists what revert will need."""

    journal: Journal
    entry_id: str

    def save(self, state: dict[str, Any]) -> None:
        """Merge ``state`` into this entry's revert state and write it to disk now."""
        with self.journal._locked() as entries:
            for e in entries:
                if e["id"] == self.entry_id:
                    e["state"].update(state)

    def done(self) -> None:
        """The fault is reverted: forget it."""
        self.journal.remove(self.entry_id)


class Journal:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or journal_path()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[dict[str, Any]]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_suffix(".lock")
        with open(lock, "a+") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            entries = self._read()
            yield entries
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries, indent=2))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)

    def _read(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except json.JSONDecodeError:
            # A torn file cannot be trusted, but must not be thrown away silently either.
            self.path.rename(self.path.with_suffix(f".corrupt-{int(time.time())}"))
            return []
        return list(data) if isinstance(data, list) else []

    def entries(self) -> list[dict[str, Any]]:
        with self._locked() as entries:
            return [dict(e) for e in entries]

    def add(self, fault_type: str, name: str, state: dict[str, Any] | None = None) -> JournalEntry:
        entry_id = uuid.uuid4().hex[:12]
        with self._locked() as entries:
            entries.append(
                {
                    "id": entry_id,
                    "type": fault_type,
                    "name": name,
                    "pid": os.getpid(),
                    "applied_at": time.time(),
                    "state": dict(state or {}),
                }
            )
        return JournalEntry(self, entry_id)

    def remove(self, entry_id: str) -> None:
        with self._locked() as entries:
            entries[:] = [e for e in entries if e["id"] != entry_id]
