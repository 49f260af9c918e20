"""Time to recovery: after a fault step's faults are reverted, when did the service come back?

Measured from the per-request samples after the run (so it needs ``load.samples: all``), once
per judged fault (each fault step and the recovery step after it): the recovery step is read as
windows of ``recovery.window`` seconds (2 s unless set) whose starts step by a tenth of that
from the revert. A window holds the requests due (open loop) or sent (closed loop) in it, each
measurement counted if it ended within the recovery step (the rule for phases,
loadgen/scorecard.py ``attribute``). A window is *within tolerance* when, for every recovery
metric, it holds at least :data:`MIN_VALUES` values and their percentile (``recovery.percentile``,
nearest rank) is within the limit that the baseline step's percentile sets, as the recovery check
judges it (run/verdicts.py). The time to recovery is from the revert to the start of the first
window from which every later window in the step is within tolerance: known to the step between
window starts, with the window's length and the requests in it behind it. When the last window
is not within tolerance, the service did not come back within the step.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.scorecard import Window, WindowLike, attribute, due_at
from streamquake.loadgen.tail import SampleTail
from streamquake.result import FaultRecord, RecoveryTime
from streamquake.run.verdicts import recovery_limit
from streamquake.scenario import HIGHER_IS_BETTER, RecoverySpec, Scenario
from streamquake.scenario.steps import judged_pairs
from streamquake.stats import percentile

MIN_VALUES = 5           # values of each metric a window needs to say the service is back
STEPS_PER_WINDOW = 10    # window starts per window length: the time resolution


@dataclass
class _Values(Stats):
    """One request's measurements that count in the recovery step, as plain values."""

    kept: dict[str, list[float]] = field(default_factory=dict)

    def _put(self, metric: str, value: float, at: float | None = None) -> None:
        self.kept.setdefault(metric, []).append(value)

    def add_gaps(self, gaps_ms: list[float], at: float | None = None) -> None:
        self.kept.setdefault("itl_ms", []).extend(gaps_ms)


def _values(s: RequestSample, home: Window) -> dict[str, list[float]]:
    cell = _Values()
    attribute(s, [home], lambda _: cell)
    return cell.kept


def time_to_recovery(samples: Sequence[RequestSample], step: str, after: WindowLike,
                     reverted_at: float, before: Mapping[str, float | None],
                     spec: RecoverySpec) -> RecoveryTime:
    """The time to recovery in the recovery step ``after`` of the fault step ``step`` whose
    faults were reverted at ``reverted_at`` (epoch s); ``before``: each recovery metric's
    percentile in the baseline step (None: not measured there)."""
    start = max(reverted_at, after.start)
    resolution = spec.window_s / STEPS_PER_WINDOW
    limits: dict[str, float | None] = {m: recovery_limit(spec, m, before.get(m))
                                       for m in spec.metrics}
    out = RecoveryTime(step=step, after=after.name, reverted_at=reverted_at, recovered=False,
                       time_s=None, within_s=round(after.end - reverted_at, 3),
                       window_s=spec.window_s, resolution_s=resolution, requests=None,
                       metrics=list(spec.metrics), percentile=spec.percentile, limits=limits)
    missing = [m for m, limit in limits.items() if limit is None]
    if missing:
        out.detail = f"no {', '.join(missing)} in the baseline step to come back to"
        return out
    if start + spec.window_s > after.end:
        out.detail = (f"the recovery step after the revert ({after.end - start:.1f} s) is "
                      f"shorter than recovery.window ({spec.window_s:g} s)")
        return out
    starts = [start + k * resolution
              for k in range(int((after.end - spec.window_s - start) / resolution + 1e-9) + 1)]
    home = Window(after.name, start, after.end)
    mine = sorted((s for s in samples if start <= due_at(s) < after.end and not s.retried),
                  key=due_at)
    due = [due_at(s) for s in mine]
    values = [_values(s, home) for s in mine]

    def within(t: float) -> tuple[bool, int]:
        lo, hi = bisect.bisect_left(due, t), bisect.bisect_left(due, t + spec.window_s)
        for metric, limit in limits.items():
            seen = sorted(v for vs in values[lo:hi] for v in vs.get(metric, ()))
            value = percentile(seen, spec.percentile)
            if len(seen) < MIN_VALUES or value is None or limit is None or (
                    value < limit if metric in HIGHER_IS_BETTER else value > limit):
                return False, hi - lo
        return True, hi - lo

    back: tuple[float, int] | None = None
    for t in reversed(starts):
        ok, n = within(t)
        if not ok:
            break
        back = (t, n)
    if back is not None:
        out.recovered = True
        out.time_s = round(back[0] - reverted_at, 3)
        out.requests = back[1]
    return out


def reverted(records: Sequence[FaultRecord], faults: Sequence[str], since: float,
             until: float) -> float | None:
    """When the last of ``faults`` was reverted between ``since`` and ``until`` (epoch s)."""
    return max((r.reverted_at for r in records if r.name in faults and r.reverted_at is not None
                and since <= r.reverted_at <= until), default=None)


def recovery_times(scenario: Scenario, windows: Sequence[WindowLike],
                   records: Sequence[FaultRecord], stats: Mapping[str, Stats],
                   samples_dir: Path, sampled: bool) -> tuple[list[RecoveryTime], list[str]]:
    """The time to recovery of each judged fault (a fault step with a baseline step before it
    and a recovery step after it), and warnings for what could not be measured."""
    spec = scenario.recovery
    if spec is None:
        return [], []
    by_name = {w.name: w for w in windows}
    pairs = [(before.name, step, after.name) for before, step, after in
             judged_pairs(scenario.timeline) if before is not None and after is not None
             and before.name in stats and step.name in by_name and after.name in by_name]
    if not pairs:
        return [], []
    if not sampled:
        return [], ["time to recovery needs the per-request samples, and load.samples is "
                    "'none': not measured"]
    samples = SampleTail(samples_dir).poll()
    out = []
    for before, step, after_name in pairs:
        after = by_name[after_name]
        at = reverted(records, step.faults, by_name[step.name].start, after.end)
        base: dict[str, float | None] = {m: stats[before].percentile(m, spec.percentile)
                                         for m in spec.metrics}
        out.append(time_to_recovery(samples, step.name, after,
                                    at if at is not None else after.start, base, spec))
    return out, []
