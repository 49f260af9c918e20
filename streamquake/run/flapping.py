"""Flapping faults in a run: switching each on and off inside its window, and splitting the
window's measurements by the state they were due in.

A flapping fault (envelope ``flap``, faults/flap.py) is applied at each on-edge and reverted at
each off-edge through the ledger, as any fault at a phase edge: journalled first, the lease
checked before each apply, a new journal entry (and claim) per on-state, its revert on the
phase's stack, so the phase's end, an abort, an error or a signal reverts it whatever its state.

The split: the window is cut at the edges (when each apply or revert began) into "on" and "off"
sub-windows, and each request of the phase is attributed to them by the rule for phases
(loadgen/scorecard.py ``attribute``): it belongs to the state it was due (or sent) in, and a
measurement that ends after the next edge saw both states and counts as ``unattributed``. It is
made from the per-request samples after the run, so it needs ``load.samples: all``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.jsontypes import JsonDict
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.scorecard import Window, attribute
from streamquake.loadgen.tail import SampleTail
from streamquake.result import FaultRecord
from streamquake.run.ledger import Ledger, PlannedFault
from streamquake.run.timeline import PhaseWindow

STATES = ("on", "off")


@dataclass
class Flapper:
    """One flapping fault in its window: the planned on-intervals (epoch s), and its state."""

    fault: PlannedFault
    ons: list[tuple[float, float]]
    record: FaultRecord | None = None
    step: str | None = None                         # the step (window) it flaps in
    on_stack: contextlib.ExitStack | None = None    # the current on-state's revert, while on
    _next: int = field(default=0)                   # index into ons of the next on-edge

    @classmethod
    def plan(cls, fault: PlannedFault, window: PhaseWindow, seed: int) -> Flapper:
        assert fault.spec.flap is not None
        # A fault named by several steps draws a pattern of its own in each (its first step's,
        # or its phase's, is drawn as ever).
        label = fault.spec.label if window.name == fault.phase else \
            f"{fault.spec.label}@{window.name}"
        ons = fault.spec.flap.on_intervals(window.end - window.start, seed, label)
        return cls(fault, [(window.start + a, window.start + b) for a, b in ons],
                   step=window.name)

    def next_edge(self) -> float | None:
        if self.on_stack is not None:
            return self.ons[self._next - 1][1]
        return self.ons[self._next][0] if self._next < len(self.ons) else None

    def switch(self, now: float, ledger: Ledger, phase_stack: contextlib.ExitStack) -> None:
        """Make the edge that is due by ``now``, if one is (LeaseLapsed: none applied)."""
        edge = self.next_edge()
        if edge is None or edge > now:
            return
        if self.on_stack is not None:
            self.on_stack.close()          # the off-edge: the ledger reverts and records it
            self.on_stack = None
            return
        self._next += 1
        self.on_stack = phase_stack.enter_context(contextlib.ExitStack())
        self.record = ledger.apply(self.on_stack, self.fault, self.record, step=self.step)


def state_windows(record: FaultRecord, window: PhaseWindow) -> list[Window]:
    """The fault's window cut at its edges into "on" and "off" sub-windows."""
    cuts = [(e.at, e.state) for e in record.edges if window.start <= e.at < window.end]
    out, t, state = [], window.start, "off"
    for at, new in cuts:
        if at > t:
            out.append(Window(state, t, at))
        t, state = at, new
    if window.end > t:
        out.append(Window(state, t, window.end))
    return out


def split_states(record: FaultRecord, window: PhaseWindow,
                 samples: Sequence[RequestSample]) -> dict[str, Stats]:
    """The window's measurements per state, by the rule for phases."""
    subs = state_windows(record, window)
    stats = {state: Stats() for state in STATES}
    for s in samples:
        attribute(s, subs, lambda state: stats[state])
    return stats


def attribute_states(records: Sequence[FaultRecord], windows: Sequence[PhaseWindow],
                     samples_dir: Path, sampled: bool) -> list[str]:
    """Fill each flapping fault's ``states``; warnings for what could not be split."""
    flapping = [r for r in records if r.edges]
    samples = SampleTail(samples_dir).poll() if flapping and sampled else []
    for record in flapping:
        # A record per window it flapped in (a step or a phase): the one its first edge is in.
        window = next((w for w in windows if w.start <= record.edges[0].at < w.end), None)
        if window is None:
            continue
        subs = state_windows(record, window)
        split = split_states(record, window, samples) if sampled else {}
        for state in STATES:
            summary: JsonDict = split[state].to_dict() if state in split else {}
            summary["seconds"] = round(sum(w.end - w.start for w in subs if w.name == state), 3)
            record.states[state] = summary
    if flapping and not sampled:
        return ["flapping faults' on/off split needs the per-request samples, and "
                "load.samples is 'none': only each state's time is reported"]
    return []
