"""Which request is scored in which phase, and the statistics of each phase and class."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.result import PhaseResult
from streamquake.run.timeline import PhaseWindow
from streamquake.scenario import Scenario


def assign_phases(
    samples: list[RequestSample], windows: list[PhaseWindow]
) -> tuple[dict[str, list[RequestSample]], dict[str, int]]:
    """A request belongs to the phase in which it was due (open loop) or sent (closed loop),
    and is scored there only if it also ended within that phase: a stream that straddles a
    phase edge saw two different worlds (a fault applied or reverted mid-stream) and would
    smear one phase's damage into the other. Returns (scored samples, straddlers) per phase."""
    scored: dict[str, list[RequestSample]] = {w.name: [] for w in windows}
    straddled = {w.name: 0 for w in windows}
    for s in samples:
        t = s.scheduled if s.scheduled is not None else s.sent
        for w in windows:
            if w.start <= t < w.end:
                ended = s.sent + (s.e2e_ms or 0.0) / 1000.0
                if ended <= w.end:
                    scored[w.name].append(s)
                else:
                    straddled[w.name] += 1
                break
    return scored, straddled


@dataclass
class Scored:
    phases: list[PhaseResult] = field(default_factory=list)
    stats: dict[str, Stats] = field(default_factory=dict)
    class_stats: dict[str, dict[str, Stats]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def score(scenario: Scenario, windows: list[PhaseWindow],
          samples: list[RequestSample]) -> Scored:
    by_phase, straddled = assign_phases(samples, windows)
    out = Scored()
    for w in windows:
        phase_samples = by_phase[w.name]
        out.stats[w.name] = Stats.from_samples(phase_samples)
        out.class_stats[w.name] = {
            rc.name: Stats.from_samples([s for s in phase_samples if s.cls == rc.name])
            for rc in scenario.load.classes
        }
        if straddled[w.name] > len(phase_samples) and w.name != "warmup":
            out.warnings.append(
                f"phase {w.name}: {straddled[w.name]} requests straddled its end and were "
                f"not scored, more than the {len(phase_samples)} that were; make the phase "
                "longer than a few request durations"
            )
        out.phases.append(PhaseResult(
            name=w.name, start=w.start, end=w.end,
            stats={**out.stats[w.name].to_dict(), "straddled": straddled[w.name]},
            classes={k: v.to_dict() for k, v in out.class_stats[w.name].items()},
        ))
    out.warnings += _late_start(windows, samples)
    return out


def _late_start(windows: list[PhaseWindow], samples: list[RequestSample]) -> list[str]:
    """The warm-up exists to absorb cold starts (new connections, first requests); if the load
    generator sent nothing before it ended, they were scored in the first measured phase."""
    if not samples or not windows or windows[0].name != "warmup":
        return []
    first = min(s.sent for s in samples)
    warmup = windows[0]
    if first < warmup.end:
        return []
    return [f"the load generator sent its first request {first - warmup.end:.1f} s after the "
            "warm-up ended, so cold-start requests (new connections) were scored in the "
            f"{windows[1].name if len(windows) > 1 else 'next'} phase; make warmup longer "
            "(this machine starts Locust slowly)"]
