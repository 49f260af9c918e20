"""Checks before anything changes. Each returns every problem it finds, as sentences."""

from __future__ import annotations

import datetime
import os

from streamquake.errors import ScenarioError
from streamquake.faults.contract import Injector, Preflights
from streamquake.journal import Journal, JournalRecord
from streamquake.loadgen import batching
from streamquake.loadgen.templates import expand_headers, expand_path
from streamquake.scenario import Scenario


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
    """What the load process would refuse in target.headers and target.path once ``${VAR}``
    is expanded from this environment (an unset variable, a line break in a value), found
    before anything starts rather than by Locust."""
    try:
        expand_headers(scenario.target.headers, os.environ)
        if scenario.target.path:
            expand_path(scenario.target.path, os.environ)
    except ScenarioError as exc:
        return [f"target: {p}" for p in exc.problems]
    return []


def environment_problems() -> list[str]:
    """Settings in this environment that the load processes would refuse (they inherit it)."""
    try:
        batching.setting(os.environ)
    except ValueError as exc:
        return [str(exc)]
    return []


def injector_problems(label: str, type_name: str, injector: Injector) -> list[str]:
    if not isinstance(injector, Preflights):
        return []
    return [f"fault '{label}' ({type_name}): {p}" for p in injector.preflight()]
