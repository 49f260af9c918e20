"""The fault journal's owners: only an entry whose writer is gone may be undone by someone else.

Owners are real child processes; the journal is a private file under tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from streamquake.errors import InjectorError
from streamquake.faults.recovery import recover_all
from streamquake.journal import Journal, JournalRecord, owner_alive, pid_start_time

REPO = Path(__file__).resolve().parent.parent

# Writes the entries given as JSON through the Journal API, says so, then holds them until killed.
# Its comm is renamed to something with spaces and ")" first, as any process may do.
OWNER = """
import json, sys, time
from pathlib import Path
Path("/proc/self/comm").write_text("sq) x (y) z")
from streamquake.journal import Journal
journal = Journal(Path(sys.argv[1]))
for fault_type, name, state in json.loads(sys.argv[2]):
    journal.add(fault_type, name, state)
print("ready", flush=True)
time.sleep(60)
"""

# A namespace that does not exist: NamespaceTopology.recover finds it already gone, and succeeds.
GONE_NETNS = {"netns": "sq-journaltest", "host_netns": None,
              "host_ifname": "sqhjournaltst", "target_ifname": "sqtjournaltst"}


@contextmanager
def owner(path: Path, entries: list[tuple[str, str, dict[str, object]]]
          ) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(path), json.dumps(entries)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", "the owner process failed to start"
        yield proc
    finally:
        proc.kill()
        proc.communicate()  # reaps it and closes the pipe


def _orphaned(path: Path, entries: list[tuple[str, str, dict[str, object]]]) -> int:
    """Entries written by a process that was then killed and reaped; returns its pid."""
    with owner(path, entries) as proc:
        pass
    return proc.pid


def _write(path: Path, data: object) -> None:
    path.write_text(json.dumps(data))


@pytest.mark.timeout(30)
def test_child_entry_is_live_then_orphan_after_kill(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    spawned = time.time()
    with owner(journal.path, [("netem", "delay", {"dev": "eth0"})]) as proc:
        (rec,) = journal.records()
        assert (rec.pid, rec.type, rec.name, rec.state) == (proc.pid, "netem", "delay",
                                                            {"dev": "eth0"})
        assert rec.pid_start is not None and rec.host
        # Its start time, read past the comm with ")" in it, is the moment we started it.
        assert rec.owner_started_at is not None
        assert spawned - 2 < rec.owner_started_at < time.time() + 2
        assert rec.owner_alive and owner_alive(proc.pid, rec.pid_start)
        assert journal.live() == [rec] and journal.orphans() == []

        proc.kill()
        # Killed but not yet reaped: a zombie reverts nothing, so it counts as gone.
        deadline = time.monotonic() + 10
        while b") Z" not in Path(f"/proc/{proc.pid}/stat").read_bytes():
            assert time.monotonic() < deadline, "the killed owner never became a zombie"
            time.sleep(0.01)
        assert not rec.owner_alive
        proc.wait()
    assert not owner_alive(rec.pid, rec.pid_start)
    assert journal.orphans() == [rec] and journal.live() == []


@pytest.mark.timeout(30)
def test_reused_pid_with_another_start_time_is_dead(tmp_path: Path) -> None:
    me, started = os.getpid(), pid_start_time(os.getpid())
    assert started is not None
    assert owner_alive(me, started) and owner_alive(me, None)
    assert not owner_alive(me, started + 1)
    assert not owner_alive(0, None)

    journal = Journal(tmp_path / "journal.json")
    _write(journal.path, [{"id": "reused", "type": "netem", "name": "n", "pid": me,
                           "pid_start": started + 1, "applied_at": 0, "state": {}}])
    assert [r.id for r in journal.orphans()] == ["reused"]
    assert journal.live(exclude_self=False) == []


@pytest.mark.timeout(30)
def test_own_entries_are_live_but_left_out_by_default(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    journal.add("netem", "mine")
    assert journal.live() == [] and journal.orphans() == []
    assert [r.name for r in journal.live(exclude_self=False)] == ["mine"]


@pytest.mark.timeout(30)
def test_recover_skips_a_live_owner_and_recovers_orphans(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    # Orphans: a topology written before a fault; the fault's type has no recoverer, so it fails
    # and stays, and the topology is still recovered after it.
    dead_pid = _orphaned(journal.path, [("netns", "sq-journaltest", GONE_NETNS),
                                        ("no-such-type", "stale", {})])
    # A live run's entry, of a type with no recoverer: calling it would show as FAILED.
    with owner(journal.path, [("no-such-type", "busy", {})]) as proc:
        lines, failed = recover_all(journal)
        assert failed
        assert lines[0].startswith(f"FAILED stale (no-such-type, applied by pid {dead_pid}): ")
        assert lines[1] == (f"recovered sq-journaltest (netns, applied by pid {dead_pid}): "
                            "sq-journaltest was already gone")
        assert lines[2].startswith(
            f"skipped busy (no-such-type): owned by the running process {proc.pid} (started ")
        assert lines[2].endswith("), still in use; stop that run first")
        assert len(lines) == 3
        assert sorted(r.name for r in journal.records()) == ["busy", "stale"]

        # Only a live owner's entry left: skipped, and that is not a failure.
        journal.remove(next(r.id for r in journal.records() if r.name == "stale"))
        lines, failed = recover_all(journal)
        assert not failed and len(lines) == 1 and lines[0].startswith("skipped busy ")
        assert [r.name for r in journal.records()] == ["busy"]


@pytest.mark.timeout(30)
def test_recover_with_nothing_in_the_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    assert recover_all(journal) == (
        [f"nothing to recover: the journal {journal.path} lists no applied fault"], False)


@pytest.mark.timeout(30)
def test_entry_removed_by_another_journal_is_not_present_and_save_raises(tmp_path: Path) -> None:
    mine = Journal(tmp_path / "journal.json")
    entry = mine.add("netem", "delay")
    assert entry.present()
    entry.save({"dev": "eth0"})
    assert mine.records()[0].state == {"dev": "eth0"}

    Journal(tmp_path / "journal.json").remove(entry.entry_id)
    assert not entry.present()
    with pytest.raises(InjectorError, match="removed by another process"):
        entry.save({"handle": "1:"})
    assert mine.entries() == []
    entry.done()  # already gone: still fine


@pytest.mark.timeout(30)
def test_torn_journal_is_moved_aside_and_reported(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    journal.path.write_text('[{"id": "abc", "type": "net')
    lines, failed = recover_all(journal)
    assert failed
    (aside,) = journal.damaged
    assert aside.read_text() == '[{"id": "abc", "type": "net'
    assert lines == [
        f"WARNING: the journal {journal.path} was damaged and moved to {aside}; faults it listed "
        "may still be in place: check by hand (tc qdisc show, ip netns list, "
        "nvidia-smi -q -d CLOCK)"
    ]
    assert journal.entries() == []


@pytest.mark.timeout(30)
def test_unreadable_entries_are_moved_aside_not_raised(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    bad: list[object] = [42, {"id": "no-type"}, {"type": "netem"}, {"id": 1, "type": "netem"}]
    good = {"id": "ok", "type": "netns", "name": "sq-journaltest", "pid": 0,
            "state": GONE_NETNS}
    _write(journal.path, [*bad, good])
    lines, failed = recover_all(journal)
    assert failed
    (aside,) = journal.damaged
    assert json.loads(aside.read_text()) == bad
    assert lines[0].startswith(f"WARNING: the journal {journal.path} was damaged and moved to "
                               f"{aside}; ")
    assert lines[1] == ("recovered sq-journaltest (netns, applied by pid 0): "
                        "sq-journaltest was already gone")
    assert json.loads(journal.path.read_text()) == []


@pytest.mark.timeout(30)
def test_old_format_entries_are_read(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    _write(journal.path, [
        {"id": "a", "type": "tbf", "name": "limit", "pid": os.getpid(), "applied_at": 12.5,
         "state": {"dev": "eth0"}},
        {"id": "b", "type": "tbf", "name": "nopid"},
    ])
    a, b = journal.records()
    assert a == JournalRecord(id="a", type="tbf", name="limit", pid=os.getpid(), pid_start=None,
                              host="", applied_at=12.5, state={"dev": "eth0"})
    assert a.owner_alive  # no start time recorded: the pid existing is all there is
    assert (b.pid, b.pid_start, b.host, b.state) == (0, None, "", {})
    assert not b.owner_alive  # unknown owner: counted as gone
    assert [r.id for r in journal.orphans()] == ["b"]
    assert [e["name"] for e in journal.entries()] == ["limit", "nopid"]
    assert journal.damaged == []


@pytest.mark.timeout(30)
def test_claims_one_owner_per_thing(tmp_path: Path, state_dir: Path) -> None:
    # Two agent leases of this process are two owners; what a claim blocks on is its entry.
    journal = Journal(tmp_path / "journal.json")
    egress = {"tc:host:eth0:egress": "the egress qdisc tree of eth0"}
    first = journal.add("tbf", "first", lease="lease-a")
    first.claim(egress, per_owner=True)
    second = journal.add("tbf", "second", lease="lease-b")
    with pytest.raises(InjectorError) as refused:
        second.claim(egress, per_owner=True)
    said = str(refused.value)
    assert said.startswith("the egress qdisc tree of eth0 is held by fault 'first' (tbf) of lease "
                           f"lease-a of the agent pid {os.getpid()} since "), said
    assert said.endswith(", so fault 'second' was not applied (two faults on it would undo each "
                         "other wrongly): revert it first (`streamquake revert first`), or wait "
                         "for its lease to end"), said
    also_first = journal.add("tbf", "also-first", lease="lease-a")
    also_first.claim(egress, per_owner=True)            # the same owner's faults stack
    with pytest.raises(InjectorError, match="held by fault 'first'"):
        journal.add("gpu_clocks", "again", lease="lease-a").claim(egress)   # unless exclusive
    # Holders killed between their revert and freeing the claim: their entries are gone, so
    # the claims are dropped by the next claimant (never blocking forever).
    _write(journal.path, [e for e in json.loads(journal.path.read_text())
                          if e["name"] not in ("first", "also-first")])
    second.claim(egress, per_owner=True)
    assert [c["entry"] for c in json.loads((state_dir / "claims.json").read_text())] == [
        second.entry_id]
    second.done()
    assert json.loads((state_dir / "claims.json").read_text()) == []


@pytest.mark.timeout(30)
def test_a_claim_whose_journal_cannot_be_read_still_holds(tmp_path: Path) -> None:
    other = Journal(tmp_path / "other.json")
    other.add("gpu_clocks", "held").claim({"gpu:GPU-1:power_limit": "the power limit of GPU 1"})
    other.path.write_text("[{torn")    # its fault may still be in place: never taken over
    with pytest.raises(InjectorError, match=(
            r"the power limit of GPU 1 is claimed by entry \w+ of the journal .*other.json, "
            r"which cannot be read")):
        Journal(tmp_path / "journal.json").add("gpu_clocks", "next").claim(
            {"gpu:GPU-1:power_limit": "the power limit of GPU 1"})


def test_reading_an_entry_writes_nothing_and_bad_entries_are_moved_aside_once(
        tmp_path: Path) -> None:
    # A fault's apply reads its entry several times (claims, lease checks): only changes are
    # written and fsynced, so reading leaves the very file (same inode) in place.
    journal = Journal(tmp_path / "journal.json")
    entry = journal.add("marker_file", "flag")
    inode = journal.path.stat().st_ino
    assert entry.record() is not None and entry.present() and len(journal.records()) == 1
    assert journal.path.stat().st_ino == inode
    entry.save({"path": "/tmp/x"})
    assert journal.path.stat().st_ino != inode
    # An unreadable entry is moved aside by the first read and the rest written back, once.
    raw = json.loads(journal.path.read_text())
    journal.path.write_text(json.dumps([*raw, {"no": "id"}]))
    assert len(journal.records()) == 1 and len(journal.records()) == 1
    assert len(list(tmp_path.glob("journal.bad-entries-*"))) == 1
    assert json.loads(journal.path.read_text()) == raw
