"""Which step (phase) each measurement of a request counts in: one rule, here, for the load
processes' scorecards, the Prometheus exporter, compare, the per-second series, recovery time and
the CSV export alike. The window type every stage names a step by is :class:`Window`.

The rule: a request belongs to the step (phase) in which it was due (open loop) or sent
(closed loop), and every one of its measurements counts there, whenever it ended: its first
byte and token, its gaps, its end, its error. A fault that makes requests outlast their step
is judged by all of them, the slowest first; a rule that kept only measurements ending within
the step judged a fault by the requests it hurt least (docs/measurement.md, "Which step a
measurement counts in", has the numbers). What was completed after the step is counted in
``ended_after`` too, so a report says how much of a step's figures came from after it. A
measurement the request's timeout cut off is *censored*: known as "at least" that long
(``Stats.add_censored``), counted in every percentile as such.

``attribute(strict=True)`` keeps the older rule for windows that split a step by time (a
flapping fault's on and off states): a measurement counts in a window only if it ended within
it, and what no window can own is counted in ``unattributed``, never dropped unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from streamquake.loadgen.samples import RequestSample


class WindowLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


@dataclass(frozen=True)
class Window:
    name: str
    start: float
    end: float


def due_at(s: RequestSample) -> float:
    return s.scheduled if s.scheduled is not None else s.sent


def ended_at(s: RequestSample) -> float:
    return s.sent + (s.e2e_ms or 0.0) / 1000.0


def window_at(t: float, windows: Sequence[WindowLike]) -> WindowLike | None:
    for w in windows:
        if w.start <= t < w.end:
            return w
    return None


class Cell(Protocol):
    """What :func:`attribute` counts a request's measurements into: a phase's ``Stats``, or
    another output that must count by the same rule (``compare``, the Prometheus exporter)."""

    late_errors: dict[str, int]

    def add_retried(self, s: RequestSample) -> None: ...

    def add_sent(self, s: RequestSample) -> None: ...

    def add_queue_delay(self, s: RequestSample) -> None: ...

    def add_unattributed(self, metric: str, n: int = 1) -> None: ...

    def add_ended_after(self, metric: str, n: int = 1) -> None: ...

    def add_censored(self, metric: str, at_least_ms: float, at: float | None = None) -> None: ...

    def add_first_byte(self, s: RequestSample) -> None: ...

    def add_first_token(self, s: RequestSample) -> None: ...

    def add_gaps(self, gaps_ms: list[float], at: float | None = None) -> None: ...

    def add_outcome(self, s: RequestSample) -> None: ...


def attribute(s: RequestSample, windows: Sequence[WindowLike],
              into: Callable[[str], Cell], strict: bool = False) -> bool:
    """Add each measurement of ``s`` to the step it belongs to (the module's rule); ``into``
    gives the stats of a step for this request's class. False if no step owns the request.
    ``strict``: the rule for windows inside a step (a measurement counts only if it ended
    within its window; gaps where they happened)."""
    home = window_at(due_at(s), windows)
    if home is None:
        return False
    here = into(home.name)
    if s.retried:
        here.add_retried(s)
        return True
    if strict:
        _attribute_within(s, home, windows, into, here)
        return True
    here.add_sent(s)
    at = due_at(s)
    after = home.end
    if s.scheduled is not None:
        here.add_queue_delay(s)
        if s.started > after:
            here.add_ended_after("queue_delay_ms")
    cut = s.error == "timeout" and s.e2e_ms is not None   # the clock ended it, not the server
    if s.ttfb_ms is not None:
        here.add_first_byte(s)
        if s.sent + s.ttfb_ms / 1000.0 > after:
            here.add_ended_after("ttfb_ms")
    elif cut:
        here.add_censored("ttfb_ms", s.e2e_ms or 0.0, at)
    if s.ttft_ms is not None:
        here.add_first_token(s)
        if s.sent + s.ttft_ms / 1000.0 > after:
            here.add_ended_after("ttft_ms")
    elif cut:
        here.add_censored("ttft_ms", s.e2e_ms or 0.0, at)
        if (waited := s.e2e_scheduled_ms) is not None:
            here.add_censored("ttft_scheduled_ms", waited, at)
    if s.itl_ms:
        here.add_gaps(s.itl_ms, at)
        if s.ttft_ms is not None:
            t = s.sent + s.ttft_ms / 1000.0
            late = 0
            for gap in s.itl_ms:
                t += gap / 1000.0
                late += t > after
            if late:
                here.add_ended_after("itl_ms", late)
    if cut and s.ttft_ms is not None:
        # The gap that was still open when the clock ran out: a stall at least this long.
        here.add_censored("itl_ms", max(0.0, (s.e2e_ms or 0.0) - s.ttft_ms - sum(s.itl_ms)), at)
    here.add_outcome(s)
    if ended_at(s) > after and not s.cancelled:
        here.add_ended_after("e2e_ms")
    if cut:
        here.add_censored("e2e_ms", s.e2e_ms or 0.0, at)
        if (waited := s.e2e_scheduled_ms) is not None:
            here.add_censored("e2e_scheduled_ms", waited, at)
    return True


def _attribute_within(s: RequestSample, home: WindowLike, windows: Sequence[WindowLike],
                      into: Callable[[str], Cell], here: Cell) -> None:
    """The strict rule: a measurement counts in ``home`` only if it ended within it."""
    here.add_sent(s)
    if s.scheduled is not None:
        if s.started <= home.end:
            here.add_queue_delay(s)
        else:
            here.add_unattributed("queue_delay_ms")
    if s.ttfb_ms is not None:
        if s.sent + s.ttfb_ms / 1000.0 <= home.end:
            here.add_first_byte(s)
        else:
            here.add_unattributed("ttfb_ms")
    first_token = None if s.ttft_ms is None else s.sent + s.ttft_ms / 1000.0
    if first_token is not None:
        if first_token <= home.end:
            here.add_first_token(s)
        else:
            here.add_unattributed("ttft_ms")
    if s.itl_ms:
        _gaps(s, first_token, windows, into, here)
    if ended_at(s) <= home.end:
        here.add_outcome(s)
    else:
        here.add_unattributed("e2e_ms")
        if s.error is not None:      # not counted as this window's error, but never unsaid
            here.late_errors[s.error] = here.late_errors.get(s.error, 0) + 1


def _gaps(s: RequestSample, first_token: float | None, windows: Sequence[WindowLike],
          into: Callable[[str], Cell], home: Cell) -> None:
    """Each gap placed in time, the first token then one after another, counted in the phase
    it started and ended in."""
    if first_token is None:
        home.add_unattributed("itl_ms", len(s.itl_ms))
        return
    t = since = first_token
    w = window_at(t, windows)
    kept: list[float] = []
    lost = 0
    for gap in s.itl_ms:
        end = t + gap / 1000.0
        if w is None or not w.start <= t < w.end:
            if kept and w is not None:
                into(w.name).add_gaps(kept, since)
                kept = []
            w = window_at(t, windows)
            since = t
        if w is not None and end <= w.end:
            kept.append(gap)
        else:
            lost += 1
        t = end
    if kept and w is not None:
        into(w.name).add_gaps(kept, since)
    if lost:
        home.add_unattributed("itl_ms", lost)
