"""Flapping faults in a run: switching each on and off inside its window, and splitting the
window's measurements by the state they were due in.

A flapping fault (envelope ``flap``, faults/flap.py) is applied at each on-edge and reverted at
each off-edge through the ledger, as any fault at a phase edge: journalled first, the lease
checked before each apply, a new journal entry (and claim) per on-state, its revert on the
phase's stack, so the phase's end, an abort, an error or a signal reverts it whatever its state.

The split: the window is cut at the edges (when each apply or revert began) into "on" and "off"
sub-windows, and each request of the phase is attributed to them by the strict rule for
windows inside a step (loadgen/scorecard.py ``attribute(strict=True)``): it belongs to the state
it was due (or sent) in, and a measurement that ends after the next edge saw both states and
counts as ``unattributed`` (the step itself counts every measurement of its requests). It is
made from the per-request samples after the run, so it needs ``load.samples: all``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from streamquake.jsontypes import JsonDict
from streamquake.loadgen.attribution import Window, attribute
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.tail import RunSamples
from streamquake.result import FaultRecord
from streamquake.run.ledger import Ledger, PlannedFault
from streamquake.run.timeline import PhaseWindow

STATES = ("on", "off")


@dataclass
class Flapper:
    """One flapping fault in its window: its on-intervals (epoch s), drawn one at a time as
    the run reaches them (a window of 10^9 s flapping every 100 ms holds one, not 5*10^9),
    and its state."""

    fault: PlannedFault
    ons: Iterator[tuple[float, float]]
    record: FaultRecord | None = None
    step: str | None = None                         # the step (window) it flaps in
    on_stack: contextlib.ExitStack | None = None    # the current on-state's revert, while on
    _coming: tuple[float, float] | None = field(default=None)   # the next (or current) on
    _drawn: bool = field(default=False)

    @classmethod
    def plan(cls, fault: PlannedFault, window: PhaseWindow, seed: int) -> Flapper:
        assert fault.spec.flap is not None
        # A fault named by several steps draws a pattern of its own in each (its first step's,
        # or its phase's, is drawn as ever).
        label = fault.spec.label if window.name == fault.phase else \
            f"{fault.spec.label}@{window.name}"
        ons = fault.spec.flap.iter_on_intervals(window.end - window.start, seed, label)
        start = window.start
        return cls(fault, ((start + a, start + b) for a, b in ons), step=window.name)

    def _peek(self) -> tuple[float, float] | None:
        if not self._drawn:
            self._coming, self._drawn = next(self.ons, None), True
        return self._coming

    def next_edge(self) -> float | None:
        coming = self._peek()
        if coming is None:
            return None
        return coming[1] if self.on_stack is not None else coming[0]

    def switch(self, now: float, ledger: Ledger, phase_stack: contextlib.ExitStack) -> None:
        """Make the edge that is due by ``now``, if one is (LeaseLapsed: none applied)."""
        edge = self.next_edge()
        if edge is None or edge > now:
            return
        if self.on_stack is not None:
            self.on_stack.close()          # the off-edge: the ledger reverts and records it
            self.on_stack = None
            self._drawn = False            # the next on-interval is drawn when asked for
            return
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
        attribute(s, subs, lambda state: stats[state], strict=True)
    return stats


def attribute_states(records: Sequence[FaultRecord], windows: Sequence[PhaseWindow],
                     run_samples: RunSamples | None) -> list[str]:
    """Fill each flapping fault's ``states`` (``run_samples``: None where the run kept no
    samples); warnings for what could not be split."""
    flapping = [r for r in records if r.edges]
    sampled = run_samples is not None
    samples = run_samples.all() if flapping and run_samples is not None else []
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
