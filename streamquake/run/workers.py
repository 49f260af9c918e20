"""Who made the load: the Locust workers a run's master saw (``workers.jsonl``, written by the
master, ``loadgen/relay.py``), turned into a list for the report and a sentence for each worker
that joined late, went missing, or whose clock is off the master's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from streamquake.jsontypes import JsonDict
from streamquake.loadgen.attribution import window_at
from streamquake.loadgen.relay import WORKERS_FILE
from streamquake.run.timeline import PhaseWindow

MAX_SKEW_S = 0.1        # one-way, network delay included: beyond this, say so


def _records(run_dir: Path) -> list[dict[str, object]]:
    out = []
    try:
        text = (run_dir / WORKERS_FILE).read_text(encoding="utf-8")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _where(t: float, windows: list[PhaseWindow]) -> str:
    if (w := window_at(t, windows)) is not None:
        return f"{w.name} phase, {t - w.start:.1f} s in"
    return "after the phases" if windows and t >= windows[-1].end else "before the phases"


@dataclass
class Worker:
    index: int
    host: str | None = None
    remote: bool = False
    state: str | None = None
    users: int = 0                    # users it ran, at the last count above zero
    joined_at: float | None = None
    missing_at: float | None = None
    clock_skew_s: float | None = None

    def to_json(self) -> JsonDict:
        return {"index": self.index, "host": self.host, "remote": self.remote,
                "state": self.state, "users": self.users, "joined_at": self.joined_at,
                "missing_at": self.missing_at, "clock_skew_s": self.clock_skew_s}


def _read(run_dir: Path) -> dict[int, Worker]:
    workers: dict[int, Worker] = {}
    for rec in _records(run_dir):
        t = rec.get("t")
        if not isinstance(t, int | float):
            continue
        index = rec.get("index")
        if "plan_to" in rec and isinstance(index, int):
            w = workers.setdefault(index, Worker(index))
            w.remote = True
            host, skew = rec.get("host"), rec.get("clock_skew_s")
            w.host = host if isinstance(host, str) else w.host
            w.clock_skew_s = float(skew) if isinstance(skew, int | float) else None
        snaps = rec.get("workers")
        for snap in snaps if isinstance(snaps, list) else []:
            if not isinstance(snap, dict) or not isinstance(snap.get("index"), int):
                continue
            w = workers.setdefault(snap["index"], Worker(snap["index"]))
            if w.joined_at is None:
                w.joined_at = float(t)
            host, state, users = snap.get("host"), snap.get("state"), snap.get("users")
            w.host = host if isinstance(host, str) else w.host
            w.state = state if isinstance(state, str) else w.state
            if isinstance(users, int) and users > 0:
                w.users = users
            if state == "missing" and w.missing_at is None:
                w.missing_at = float(t)
    return workers


def summarise(run_dir: Path, windows: list[PhaseWindow]) -> tuple[list[JsonDict], list[str]]:
    """(one entry per worker, warnings); both empty for a run without Locust workers."""
    workers = _read(run_dir)
    warnings: list[str] = []
    total = sum(w.users for w in workers.values())
    first_end = windows[0].end if windows else None
    for w in sorted(workers.values(), key=lambda w: w.index):
        label = f"load process w{w.index} on {w.host or 'an unknown host'}"
        if w.missing_at is not None:
            where = _where(w.missing_at, windows)
            if total:
                warnings.append(
                    f"{label} went missing (no heartbeat: killed, or cut off from the master) "
                    f"in the {where}: its {w.users} of {total} users stopped sending from "
                    f"then on, so what followed ran with about {100 * w.users / total:.0f}% "
                    "less load")
            else:
                warnings.append(f"{label} went missing in the {where}")
        if w.joined_at is not None and first_end is not None and w.joined_at > first_end:
            warnings.append(f"{label} joined {w.joined_at - first_end:.1f} s after the warm-up "
                            f"ended ({_where(w.joined_at, windows)}): the load before that was "
                            "lower")
        if w.clock_skew_s is not None and abs(w.clock_skew_s) > MAX_SKEW_S:
            warnings.append(f"{label}: its clock is {w.clock_skew_s:+.2f} s off the master's "
                            "(network delay included); phases are absolute times, so its "
                            "requests are placed up to that much off: sync the clocks (NTP)")
    return [w.to_json() for w in sorted(workers.values(), key=lambda w: w.index)], warnings
