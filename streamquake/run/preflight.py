"""Checks before anything changes. Each returns every problem it finds, as sentences."""

from __future__ import annotations

import datetime
import os

from streamquake.faults.contract import Injector, Preflights
from streamquake.journal import Journal, JournalRecord
from streamquake.scenario import ENV_REF, Scenario


def _when(record: JournalRecord) -> str:
    return datetime.datetime.fromtimestamp(record.applied_at).isoformat(timespec="seconds")


def journal_problems(journal: Journal) -> tuple[list[str], list[str]]:
    """(problems, warnings): faults left by a run that is gone block a new run until
    ``streamquake recover``; faults held by another live run only warn, and are never touched."""
    problems, warnings = [], []
    orphans = journal.orphans()
    if orphans:
        names = ", ".join(f"{r.name} ({r.type}, pid {r.pid}, applied {_when(r)})"
                          for r in orphans)
        problems.append(
            f"the fault journal {journal.path} lists {len(orphans)} fault(s) left by a run that "
            f"is gone: {names}; run `streamquake recover` first"
        )
    for aside in journal.damaged:
        problems.append(
            f"the fault journal was damaged and moved to {aside}: faults it listed may still be "
            "in place; check by hand (tc qdisc show, ip netns list, nvidia-smi -q -d CLOCK), "
            "then remove that file"
        )
    live = journal.live()
    if live:
        names = ", ".join(f"{r.name} ({r.type}, pid {r.pid})" for r in live)
        warnings.append(f"another streamquake run on this host holds fault(s) now: {names}; "
                        "they may affect this run's measurements")
    return problems, warnings


def header_problems(scenario: Scenario) -> list[str]:
    missing = sorted(
        {name for value in scenario.target.headers.values()
         for name in ENV_REF.findall(value) if name not in os.environ}
    )
    if not missing:
        return []
    return [f"target.headers refer to environment variable(s) that are not set: "
            f"{', '.join(missing)}; export them before the run"]


def injector_problems(label: str, type_name: str, injector: Injector) -> list[str]:
    if not isinstance(injector, Preflights):
        return []
    return [f"fault '{label}' ({type_name}): {p}" for p in injector.preflight()]
