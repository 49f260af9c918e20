"""Load processes on other hosts: the plan comes from the master and every record goes back to
it, both over Locust's own master/worker connection (its custom messages); no shared disk and
no transport of ours.

On a worker started by ``streamquake worker --master HOST:PORT`` (``$STREAMQUAKE_REMOTE=1``):

* at init it asks the master for the load plan (``sq_plan_request``), and the master answers
  with the plan it wrote (``sq_plan``); users wait for it (at most :data:`PLAN_WAIT_S`);
* its scorecard (loadgen/scorecard.py: per phase and class, exact mergeable HDR histograms) is
  sent whole (``sq_scorecard``) every checkpoint and once more when its users have stopped,
  *before* it says so (messages from one worker arrive in order); the master keeps the latest
  as ``scorecard-w<index>.json`` beside the local processes', and the runner merges them all;
* every record a local process would append to a file (request samples unless
  ``load.samples`` is none, arrivals never sent, the saturation guard's seconds, the
  timeline's sealed seconds) is buffered
  here and sent as whole lines (``sq_records``) every :data:`FLUSH_S`, and once more at the
  end, so nothing measured is left behind.

The master appends each worker's lines to ``<kind>-w<index>.jsonl`` in the same folders its
local processes use, so the runner reads remote and local records alike. It also writes, every
second, which workers are connected and in what state (``workers.jsonl`` in the run folder):
a worker that joins late, goes missing (killed, partitioned) or quits shows in the report.

Runs under gevent (inside the locustfile) only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from streamquake.loadgen.holds import Hold
from streamquake.loadgen.scorecard import replace_text

REMOTE_ENV = "STREAMQUAKE_REMOTE"
PLAN_WAIT_S = 60.0
FLUSH_S = 0.5
WORKERS_FILE = "workers.jsonl"
KINDS = ("samples", "unsent", "saturation", "seconds")


def is_remote() -> bool:
    return os.environ.get(REMOTE_ENV) == "1"


class Relay:
    """A remote worker's outbox: whole lines per kind, sent every FLUSH_S."""

    def __init__(self, runner: Any) -> None:
        import gevent

        self.runner = runner
        self._pending: dict[str, list[str]] = {k: [] for k in KINDS}
        self._partial: dict[str, str] = {k: "" for k in KINDS}
        self.sent_lines = 0
        self._greenlet = gevent.spawn(self._loop)

    def add(self, kind: str, text: str) -> None:
        """Buffer ``text``; only whole lines leave (a record split over two writes stays one)."""
        text = self._partial[kind] + text
        head, _, tail = text.rpartition("\n")
        self._partial[kind] = tail
        if head:
            self._pending[kind].append(head + "\n")

    def flush(self) -> None:
        for kind, chunks in self._pending.items():
            if not chunks:
                continue
            hold = Hold()
            text = "".join(chunks)
            chunks.clear()
            self.runner.send_message("sq_records", {"kind": kind, "text": text})
            self.sent_lines += text.count("\n")
            hold.done("relay")

    def send_scorecard(self, text: str) -> None:
        """The whole scorecard (it replaces the last one the master holds from us); records
        before it go first, so the master never has a card newer than its lines."""
        self.flush()
        self.runner.send_message("sq_scorecard", {"text": text})

    def _loop(self) -> None:
        import gevent

        while True:
            gevent.sleep(FLUSH_S)
            self.flush()

    def close(self) -> None:
        self.flush()
        self._greenlet.kill(block=False)


class RelaySink:
    """What the record writers see in place of a file."""

    def __init__(self, relay: Relay, kind: str) -> None:
        self.relay = relay
        self.kind = kind

    def write(self, text: str) -> int:
        self.relay.add(self.kind, text)
        return len(text)

    def flush(self) -> None:
        pass    # lines leave with the relay's next flush

    def close(self) -> None:
        pass


# -- the master's side -------------------------------------------------------------------------


class Inbox:
    """On the master: each worker's records appended to files beside the local processes'."""

    def __init__(self, runner: Any, samples_dir: Path, run_dir: Path, cards_dir: Path) -> None:
        self.runner = runner
        self.dirs = {"samples": samples_dir, "unsent": samples_dir, "saturation": run_dir}
        self.cards_dir = cards_dir
        self.dirs["seconds"] = cards_dir          # the timeline's sealed seconds, per worker
        self._files: dict[tuple[str, int], Any] = {}

    def on_records(self, environment: Any, msg: Any, **_: Any) -> None:
        data = msg.data if isinstance(msg.data, dict) else {}
        kind, text = data.get("kind"), data.get("text")
        if kind not in self.dirs or not isinstance(text, str):
            return
        index = self.runner.get_worker_index(msg.node_id)
        key = (kind, index)
        fh = self._files.get(key)
        if fh is None:
            self.dirs[kind].mkdir(parents=True, exist_ok=True)
            fh = self._files[key] = open(  # noqa: SIM115 - closed by close()
                self.dirs[kind] / f"{kind}-w{index}.jsonl", "a", encoding="utf-8")
        fh.write(text)
        fh.flush()

    def on_scorecard(self, environment: Any, msg: Any, **_: Any) -> None:
        data = msg.data if isinstance(msg.data, dict) else {}
        text = data.get("text")
        if not isinstance(text, str):
            return
        index = self.runner.get_worker_index(msg.node_id)
        self.cards_dir.mkdir(parents=True, exist_ok=True)
        replace_text(self.cards_dir / f"scorecard-w{index}.json", text)

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def watch_workers(runner: Any, run_dir: Path, until: float) -> None:
    """Every second, each worker's state and users, as one line when anything changed."""
    import gevent

    last: dict[str, tuple[str, int]] = {}
    with open(run_dir / WORKERS_FILE, "a", encoding="utf-8") as fh:
        while time.time() < until + 120:
            now: dict[str, tuple[str, int]] = {}
            for node in list(runner.clients.values()):
                users = sum(getattr(node, "user_classes_count", {}).values())
                now[node.id] = (str(node.state), int(users))
            gone = set(last) - set(now)
            if now != last or gone:
                fh.write(json.dumps({
                    "t": time.time(),
                    "workers": [{"id": cid, "index": runner.get_worker_index(cid),
                                 "host": cid.rsplit("_", 1)[0], "state": st, "users": users}
                                for cid, (st, users) in sorted(now.items())],
                    "removed": sorted(gone),
                }) + "\n")
                fh.flush()
                last = now
            gevent.sleep(1.0)


def note_worker(run_dir: Path, runner: Any, client_id: str, skew_s: float | None) -> None:
    """A worker asked for the plan: when, from which host, and how far its clock is from ours
    (one-way, so it includes the network's delay; phases are absolute times, so clocks must
    agree)."""
    with open(run_dir / WORKERS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"t": time.time(), "plan_to": client_id,
                             "index": runner.get_worker_index(client_id),
                             "host": client_id.rsplit("_", 1)[0], "clock_skew_s": skew_s}) + "\n")
