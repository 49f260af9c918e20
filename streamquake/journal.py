"""An on-disk record of every fault applied and not yet reverted.

Written *before* a fault changes anything, so that a process killed mid-fault leaves enough
behind for ``streamquake recover`` (or the next ``run``'s refusal to start) to undo it.

Every entry names its owner by pid *and* the pid's start time, because the journal is shared by
every run on the host: only an entry whose owner is gone (an orphan) may be undone by someone
else, and a bare pid cannot tell a live owner from a new process that reused its number.

Every entry also holds *claims* on what its fault changes (a GPU's power limit, an interface's
egress, an SSE proxy), in ``claims.json`` beside the run journal, shared by every run and agent of
this state directory: a second owner's fault on a claimed thing is refused with a sentence naming
the holder, because its revert could not restore what the first left (``JournalEntry.claim``).

Location: ``$STREAMQUAKE_STATE_DIR/journal.json`` if set, else
``$XDG_STATE_HOME/streamquake/journal.json`` (``~/.local/state/streamquake/journal.json``).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.errors import InjectorError, StreamquakeError
from streamquake.jsontypes import JsonDict

# /proc/<pid>/stat, after the ")" that closes comm: field 3 (state) is index 0, 22 (starttime) 19.
_STATE_IDX, _STARTTIME_IDX = 0, 19


def state_dir() -> Path:
    explicit = os.environ.get("STREAMQUAKE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "streamquake"


def journal_path() -> Path:
    return state_dir() / "journal.json"


def claims_path() -> Path:
    return state_dir() / "claims.json"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime in clock ticks since boot) of ``pid``, or None if there is no such pid."""
    if pid <= 0:
        return None
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:  # gone, or exited between open and read (ESRCH)
        return None
    # comm is user-controlled and may hold spaces and ")": only the last ")" is reliable.
    fields = raw[raw.rfind(")") + 1:].split()
    try:
        return fields[_STATE_IDX], int(fields[_STARTTIME_IDX])
    except (IndexError, ValueError):
        return None


def pid_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (None if gone or /proc is missing)."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def owner_alive(pid: int, pid_start: int | None) -> bool:
    """Whether the process that wrote an entry still runs (same pid, same start time)."""
    stat = _proc_stat(pid)
    # A zombie has finished: it will revert nothing, only its parent has yet to reap it.
    if stat is None or stat[0] in ("Z", "X"):
        return False
    # Entries written before pid_start existed: the pid is all there is to go on.
    return pid_start is None or stat[1] == pid_start


def ticks_to_epoch(pid_start: int) -> float | None:
    """Wall-clock time of a start time in ticks since boot, for display (None without /proc)."""
    try:
        stat = Path("/proc/stat").read_text()
    except OSError:
        return None
    btime = next((int(ln.split()[1]) for ln in stat.splitlines() if ln.startswith("btime ")), None)
    return None if btime is None else btime + pid_start / os.sysconf("SC_CLK_TCK")


def _is_entry(raw: object) -> bool:
    # Anything else (hand edits, a future format) cannot be recovered or even removed by id.
    return (isinstance(raw, dict) and isinstance(raw.get("id"), str)
            and isinstance(raw.get("type"), str) and isinstance(raw.get("state", {}), dict))


def _int_or(raw: object, default: int | None) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else default


@contextlib.contextmanager
def _locked_list(path: Path, read: Callable[[], list[JsonDict]],
                 write: Callable[[], bool] = lambda: True) -> Iterator[list[JsonDict]]:
    """A JSON list file under an exclusive lock; written back (to a temporary file renamed into
    place, so a reader sees the old list or the new one, never half) when the block ends without
    an exception, unless ``write()`` says it only read.

    Not fsynced: the journal guards against a killed *process*, whose writes the kernel keeps;
    everything it records (qdiscs, namespaces, GPU clock locks and power limits, proxy
    processes) dies with the machine too, so a crash leaves nothing for it to undo. Three
    fsyncs a fault were most of what applying one cost (benchmarks/tc_apply_revert.py)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise StreamquakeError(
            f"cannot use the state directory {path.parent}: {exc.strerror or exc}; it holds the "
            "journal that makes every fault undoable, so nothing was changed (set "
            "STREAMQUAKE_STATE_DIR to a writable directory)") from None
    with lock as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        items = read()
        yield items
        if not write() and path.exists():
            return          # only read: nothing to write (a missing file is made, as ever)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(items, indent=2))
        os.replace(tmp, path)


@dataclass(frozen=True)
class JournalRecord:
    """One journal entry, typed; older files lack ``pid_start``/``host`` (and maybe ``pid``)."""

    id: str
    type: str
    name: str
    pid: int  # 0: unknown owner, counted as gone
    pid_start: int | None
    host: str
    applied_at: float
    state: dict[str, object] = field(default_factory=dict)
    lease: str | None = None  # the agent lease it belongs to; None: the process is the owner

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> JournalRecord:
        """Raises ValueError for an entry without a string ``id`` and ``type``."""
        if not _is_entry(raw):
            raise ValueError(f"not a journal entry: {raw!r}")
        state, lease = raw.get("state", {}), raw.get("lease")
        applied_at = raw.get("applied_at")
        return cls(
            id=str(raw["id"]),
            type=str(raw["type"]),
            name=str(raw.get("name", "")),
            pid=_int_or(raw.get("pid"), None) or 0,
            pid_start=_int_or(raw.get("pid_start"), None),
            host=str(raw.get("host", "")),
            applied_at=float(applied_at) if isinstance(applied_at, int | float) else 0.0,
            state=dict(state) if isinstance(state, dict) else {},
            lease=lease if isinstance(lease, str) else None,
        )

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "type": self.type, "name": self.name, "pid": self.pid,
                "pid_start": self.pid_start, "host": self.host, "applied_at": self.applied_at,
                "state": dict(self.state), "lease": self.lease}

    @property
    def owner_alive(self) -> bool:
        return owner_alive(self.pid, self.pid_start)

    @property
    def owner_started_at(self) -> float | None:
        """When the owner started (epoch seconds), if known."""
        return None if self.pid_start is None else ticks_to_epoch(self.pid_start)


@dataclass
class JournalEntry:
    """A live handle on one fault's record; ``save`` persists what revert will need."""

    journal: Journal
    entry_id: str

    def record(self) -> JournalRecord | None:
        with self.journal._locked(write=False) as entries:
            found = next((e for e in entries if e["id"] == self.entry_id), None)
        return None if found is None else JournalRecord.from_json(found)

    def claim(self, things: Mapping[str, str], *, per_owner: bool = False) -> None:
        """Hold ``things`` (key -> the thing in words: ``gpu:<uuid>:power_limit`` -> "the power
        limit of GPU 0 (...)") for this fault until ``done``: all at once, before anything
        changes. Raises InjectorError, one sentence naming the holder and how to end it, if
        another owner holds one. ``per_owner``: other faults of this same owner (one run, or
        one agent lease) share them, for a family that composes its own faults on one thing."""
        Claims().take(self, things, per_owner)

    def present(self) -> bool:
        """Whether the entry is still on disk: another process may have removed it under us."""
        with self.journal._locked(write=False) as entries:
            return any(e["id"] == self.entry_id for e in entries)

    def save(self, state: JsonDict) -> None:
        """Merge ``state`` into this entry's revert state and write it to disk now."""
        with self.journal._locked() as entries:
            for e in entries:
                if e["id"] == self.entry_id:
                    saved = e.get("state")
                    e["state"] = {**saved, **state} if isinstance(saved, dict) else dict(state)
                    return
            # Saving into nothing would let the caller change the system with no record of it.
            raise InjectorError(
                f"the journal entry {self.entry_id} in {self.journal.path} was removed by "
                "another process (a `streamquake recover` or a second run?): stopping before "
                "changing anything it would not know to undo"
            )

    def done(self) -> None:
        """The fault is reverted: forget it."""
        self.journal.remove(self.entry_id)


class Journal:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or journal_path()
        # Files moved aside by this object (a torn journal, or entries nobody can read):
        # ``recover_all`` reports them, because the faults they listed may still be in place.
        self.damaged: list[Path] = []

    @contextlib.contextmanager
    def _locked(self, write: bool = True) -> Iterator[list[JsonDict]]:
        """The entries under the lock; written back unless only read (``write=False``) and the
        read moved nothing aside (then what it kept is written back, once)."""
        damaged = len(self.damaged)
        with _locked_list(self.path, self._read,
                          lambda: write or len(self.damaged) > damaged) as entries:
            yield entries

    def _aside(self, kind: str, suffix: str = "") -> Path:
        # Unique per call: two damaged files in one second must not overwrite each other.
        stamp = f"{int(time.time())}-{uuid.uuid4().hex[:6]}"
        return self.path.parent / f"{self.path.stem}.{kind}-{stamp}{suffix}"

    def _read(self) -> list[JsonDict]:
        """The well-formed entries; anything unreadable is moved aside (never thrown away)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            data = None     # RecursionError: nested past the parser's depth (hand-made, hostile)
        if not isinstance(data, list):
            aside = self._aside("corrupt")
            self.path.rename(aside)
            self.damaged.append(aside)
            return []
        good = [e for e in data if _is_entry(e)]
        bad = [e for e in data if not _is_entry(e)]
        if bad:
            aside = self._aside("bad-entries", ".json")
            aside.write_text(json.dumps(bad, indent=2))
            self.damaged.append(aside)
        return good

    def records(self) -> list[JournalRecord]:
        with self._locked(write=False) as entries:
            return [JournalRecord.from_json(e) for e in entries]

    def entries(self) -> list[dict[str, object]]:
        """The entries as dicts, every key filled in (old entries included)."""
        return [r.to_json() for r in self.records()]

    def orphans(self) -> list[JournalRecord]:
        """Entries whose owner is gone: safe for anyone to undo."""
        return [r for r in self.records() if not r.owner_alive]

    def live(self, exclude_self: bool = True) -> list[JournalRecord]:
        """Entries whose owner still runs: theirs to undo, not ours."""
        me = os.getpid()
        return [r for r in self.records()
                if r.owner_alive and not (exclude_self and r.pid == me)]

    def add(self, fault_type: str, name: str, state: JsonDict | None = None,
            lease: str | None = None) -> JournalEntry:
        """A new entry owned by this process, or by one of its agent leases (``lease``)."""
        entry_id = uuid.uuid4().hex[:12]
        pid = os.getpid()
        with self._locked() as entries:
            entries.append(
                {
                    "id": entry_id,
                    "type": fault_type,
                    "name": name,
                    "pid": pid,
                    "pid_start": pid_start_time(pid),
                    "host": socket.gethostname(),
                    "applied_at": time.time(),
                    "state": dict(state or {}),
                    "lease": lease,
                }
            )
        return JournalEntry(self, entry_id)

    def remove(self, entry_id: str) -> None:
        """Forget an entry whose fault is undone, and free what it claimed."""
        with self._locked() as entries:
            entries[:] = [e for e in entries if e["id"] != entry_id]
        Claims().release(self.path, entry_id)


def _when(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).isoformat(timespec="seconds")


def _same_owner(a: JournalRecord, b: JournalRecord) -> bool:
    return (a.host, a.pid, a.pid_start, a.lease) == (b.host, b.pid, b.pid_start, b.lease)


def _refusal(what: str, holder: JournalRecord, mine: JournalRecord, since: float) -> str:
    if holder.lease:
        who = f"lease {holder.lease} of the agent pid {holder.pid}"
        how = (f"revert it first (`streamquake revert {holder.name}`), or wait for its lease to "
               "end" if holder.owner_alive else "that agent is gone: start it again (its start "
               "restores what it held; `streamquake status` starts the local agent), then try "
               "again")
    else:
        who = f"the run pid {holder.pid}"
        how = ("wait for that run's phase to end, or stop it (its revert restores what was there "
               "before)" if holder.owner_alive else "that run is gone: run `streamquake "
               "recover` (it restores what the run changed), then try again")
    return (f"{what} is held by fault '{holder.name}' ({holder.type}) of {who} since "
            f"{_when(since)}, so fault '{mine.name}' was not applied (two faults on it would "
            f"undo each other wrongly): {how}")


class Claims:
    """What applied faults hold (``claims.json`` beside the run journal): one owner per thing.

    A claim names its fault's journal entry and is freed when that entry goes (``Journal.remove``,
    after a revert or a recovery); one whose entry is gone already (its holder died between the
    two) is dropped by the next claimant. One whose entry is still there is never taken over,
    whether its owner lives or not: its fault may still be in place, and only undoing it (the
    owner's revert, ``recover``, a killed agent's next start) restores what was there before.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or claims_path()

    def _read(self) -> list[JsonDict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError, RecursionError) as exc:
            # Dropping what it lists could let a second fault overwrite an unrestored original.
            raise InjectorError(
                f"the fault claims file {self.path} cannot be read ({exc}): no fault is applied "
                "until it is; once `streamquake recover` and every agent hold nothing, remove it"
            ) from exc
        return [c for c in data if isinstance(c, dict) and all(
            isinstance(c.get(k), str) for k in ("thing", "journal", "entry"))
        ] if isinstance(data, list) else []

    def take(self, entry: JournalEntry, things: Mapping[str, str], per_owner: bool) -> None:
        """See ``JournalEntry.claim``."""
        mine = entry.record()
        if mine is None:
            raise InjectorError(f"the journal entry {entry.entry_id} in {entry.journal.path} was "
                                "removed by another process: stopping before changing anything")
        journal = str(entry.journal.path.resolve())

        def ours(c: JsonDict) -> bool:
            return bool(c["journal"] == journal and c["entry"] == mine.id)

        with _locked_list(self.path, self._read) as claims:
            for c in [c for c in claims if c["thing"] in things and not ours(c)]:
                holder = _holder(c)
                if holder is None:      # its fault is undone; it died before freeing this
                    claims.remove(c)
                elif not (per_owner and c.get("per_owner") and _same_owner(holder, mine)):
                    since = c.get("since")
                    raise InjectorError(_refusal(
                        str(c.get("what") or c["thing"]), holder, mine,
                        since if isinstance(since, int | float) else holder.applied_at))
            have = {c["thing"] for c in claims if ours(c)}
            claims.extend({"thing": thing, "what": what, "journal": journal, "entry": mine.id,
                           "per_owner": per_owner, "since": time.time()}
                          for thing, what in things.items() if thing not in have)

    def prune(self) -> list[str]:
        """Drop the claims whose journal entry is gone (their holder died between reverting and
        freeing, e.g. SIGKILL at a step edge); returns what each named. A claim whose journal
        cannot be read is kept: its fault may still be in place."""
        if not self.path.exists():
            return []
        dropped: list[str] = []

        def gone(c: JsonDict) -> bool:
            try:
                return _holder(c) is None
            except InjectorError:
                return False

        with _locked_list(self.path, self._read, lambda: bool(dropped)) as claims:
            keep = [c for c in claims if not gone(c)]
            dropped = [str(c.get("what") or c["thing"]) for c in claims if c not in keep]
            claims[:] = keep
        return dropped

    def release(self, journal: Path, entry_id: str) -> None:
        """Free what the entry ``entry_id`` of ``journal`` holds."""
        if not self.path.exists():
            return
        path = str(journal.resolve())
        with contextlib.suppress(InjectorError), _locked_list(self.path, self._read) as claims:
            claims[:] = [c for c in claims if (c["journal"], c["entry"]) != (path, entry_id)]


def _holder(claim: JsonDict) -> JournalRecord | None:
    """The journal entry behind a claim; None once its fault is undone (the entry is gone).

    Read without the journal's lock (writes replace the file whole) and never repaired here: a
    journal that cannot be read keeps its claims, whose faults may still be in place."""
    path = Path(str(claim["journal"]))
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError("not a list of entries")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        raise InjectorError(
            f"{claim.get('what') or claim['thing']} is claimed by entry {claim['entry']} of the "
            f"journal {path}, which cannot be read ({exc}): check that journal by hand"
        ) from exc
    found = next((e for e in data if _is_entry(e) and e["id"] == claim["entry"]), None)
    return None if found is None else JournalRecord.from_json(found)
