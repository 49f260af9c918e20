"""The result of one run: what reports render. Reports compute nothing the runner did not."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from streamquake.jsontypes import JsonDict


@dataclass
class Check:
    """One SLO evaluated in one phase (and class), or one recovery-vs-baseline comparison."""

    name: str
    kind: str                      # "slo" | "recovery"
    phase: str
    metric: str
    op: str                        # "<=" | ">="
    threshold: float
    observed: float | None
    passed: bool
    gating: bool                   # counts toward the exit code
    cls: str | None = None
    percentile: float | None = None
    detail: str = ""
    ran: bool = True               # False: its phase never started (the run stopped before it)
    samples: int | None = None     # how many values (or trials, for a rate) stand behind it
    effective_samples: int | None = None   # ... worth as independent ones, by the spread of the
                                   #   phase's time batches (<= samples: requests that queue
                                   #   behind each other depend on each other)
    ci_low: float | None = None    # the confidence interval of the observed value; None: that
    ci_high: float | None = None   #   side cannot be bounded with this many samples
    confidence: float | None = None
    inconclusive: bool = False     # the interval straddles the threshold
    samples_needed: int | None = None  # inconclusive as too few values bound the percentile on
                                   #   the limit's side: how many independent ones would
    measurable: bool = True        # False: the metric cannot be measured here (``detail`` says
                                   #   why); it gates as the scenario's verdicts.unmeasurable
    judges: str | None = None      # a recovery check: the fault step it judges (steps: each
                                   #   fault step against its baseline before, recovery after)
    not_judged: str | None = None  # a timing check in a step whose timings the saturation
                                   #   guard marked distorted: why ("the load generator was
                                   #   saturated (...)"); neither met nor broken by its value,
                                   #   it gates as verdicts.saturated (run/saturation.py)
    at_least: bool = False         # ``observed`` is a lower bound: requests whose timeout cut
                                   #   the measurement off could move the percentile


@dataclass
class FlapEdge:
    """One switch of a flapping fault: when it began (epoch s), to which state, how long the
    apply or revert took, and what went wrong, if anything."""

    at: float
    state: str                     # "on" (applied) | "off" (reverted)
    took_ms: float | None = None
    error: str | None = None


@dataclass
class FaultRecord:
    name: str
    type: str
    phase: str
    configured: JsonDict
    applied_at: float | None = None
    applied: JsonDict | None = None
    settings: str = ""             # what the scenario set, in its units, for people
    apply_ms: float | None = None  # how long applying it took
    reverted_at: float | None = None
    reverted: JsonDict | None = None
    owner: str = ""                # host:pid of the process that applied it
    error: str | None = None
    at: str = "local"              # where it ran: "local" or the agent's name (scenario agents)
    # A flapping fault (envelope ``flap``): one record for all its switches, each an edge, and
    # its phase's measurements split by the state they were due in ("on", "off"; run/flapping.py).
    edges: list[FlapEdge] = field(default_factory=list)
    states: dict[str, JsonDict] = field(default_factory=dict)


@dataclass
class PhaseResult:
    """One step of the timeline (a phase of ``phases:`` is the step named as its kind)."""

    name: str
    start: float
    end: float
    stats: JsonDict
    classes: dict[str, JsonDict] = field(default_factory=dict)
    status: str = "complete"       # "complete" | "partial" (the run stopped in it) | "not run"
                                   #   | "skipped" (a fault step after an abort: no fault, no
                                   #   verdict)
    kind: str = ""                 # warmup | baseline | fault | recovery
    faults: list[str] = field(default_factory=list)   # the faults the scenario runs in it
    load: JsonDict | None = None   # its own load (steps' ``load``), as the scenario gave it


@dataclass
class JudgedFault:
    """A fault step and the steps it is judged against: the baseline step before it and the
    recovery step after it (None where the timeline has none)."""

    step: str
    faults: list[str]
    before: str | None
    after: str | None


@dataclass
class RecoveryTime:
    """How long after a fault step's revert the service came back (run/recovery_time.py), from
    windows of requests that each hold enough of them to bound the percentile: ``time_s``, the
    start of the first window from which every later window's percentile is within tolerance of
    the baseline step's (None: no such window), between ``earliest_s`` and ``latest_s``, the
    times the windows' confidence intervals allow."""

    step: str                      # the fault step (with ``phases:``, "fault")
    after: str                     # the recovery step it was measured in
    reverted_at: float             # epoch s the step's faults were reverted
    recovered: bool                # time_s is known
    time_s: float | None           # revert -> the start of that window; None: not recovered, or
                                   #   unknown (``not_recovered`` says which)
    within_s: float                # revert -> the recovery step's end: how long it had
    window_s: float                # each window's shortest length (recovery.window)
    resolution_s: float            # the step between window starts
    requests: int | None           # requests behind the window it came back at
    metrics: list[str] = field(default_factory=list)
    percentile: float | None = None
    limits: dict[str, float | None] = field(default_factory=dict)  # metric -> the limit (the
                                   #   before-level plus tolerance and slack)
    detail: str = ""               # why it could not be measured, when it could not
    earliest_s: float | None = None  # the earliest time the windows' intervals allow (after
                                   #   the last window whose percentile is over the limit
                                   #   with that confidence); None: not recovered, not measured
    latest_s: float | None = None  # the latest: from it on every window's percentile is within
                                   #   the limit with that confidence; None: no such window
    confidence: float = 0.95       # of those intervals (the scenario's verdicts.confidence)
    not_recovered: bool = False    # the evidence says so: the last window's percentile is over
                                   #   the limit with that confidence
    why: str = ""                  # not recovered: the last window's evidence; neither back
                                   #   nor not recovered: why nothing more can be said
    needed: int | None = None      # requests a window needs to bound its percentile
    span_s: float | None = None    # the length of the window it came back at (longer than
                                   #   window_s where that holds too few requests)
    carried: int = 0               # requests due in the fault step still open after the revert
    carried_until_s: float | None = None  # revert -> when the last of them ended
    dependence: dict[str, float] = field(default_factory=dict)  # metric -> the recovery step's
                                   #   design effect: its requests count as this many times
                                   #   fewer independent ones in the windows' intervals

    @property
    def text(self) -> str:
        """``came back after 3.1 s (2.6-3.4 s at 95%; window of 72 requests, 12.0 s)``, ``not
        recovered within 4.0 s (...)``, ``unknown: too few requests (...)``."""
        if self.detail:
            return f"not measured: {self.detail}"
        conf = f"{self.confidence * 100:g}%"
        if self.not_recovered:
            return f"not recovered within {self.within_s:.1f} s" + (
                f" ({self.why})" if self.why else "")
        low = "?" if self.earliest_s is None else f"{self.earliest_s:.1f}"
        if not self.recovered or self.time_s is None:
            return f"unknown: {self.why} (at least {low} s at {conf})"
        high = (f"-{self.latest_s:.1f} s" if self.latest_s is not None else
                " s to unknown: too few requests to show it back")
        span = "" if self.span_s is None else f", {self.span_s:.1f} s"
        return (f"came back after {self.time_s:.1f} s ({low}{high} at {conf}; window of "
                f"{self.requests} requests{span})")


@dataclass
class SecondStats:
    """One second of the run. Each request counts in the second it was sent (due, in open
    loop), the same rule that assigns it to a phase; percentiles are nearest rank over the
    values of that second, at 2 significant digits (loadgen/scorecard.py), and ``n`` says how
    many values stand behind each."""

    t: float                                   # start of the second, s after the first phase
    phase: str
    sent: int                                  # requests sent in this second
    errors: int                                # of those, failed
    in_flight: int                             # streams open at the middle of this second
    p50: dict[str, float | None] = field(default_factory=dict)   # metric -> value
    p95: dict[str, float | None] = field(default_factory=dict)
    n: dict[str, int] = field(default_factory=dict)


@dataclass
class Cdf:
    """A phase's latency distribution from its HDR histogram: (percentile, value) points."""

    phase: str
    metric: str
    count: int
    points: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class TrendPoint:
    """One earlier (or this) run of the same scenario, from the history store."""

    run_id: int
    started_at: float
    exit_code: int
    values: dict[str, float | None] = field(default_factory=dict)   # "phase.metric.stat"
    # This run only: the default `streamquake history` check's regressed keys and sentence.
    regressed: list[str] = field(default_factory=list)
    judgement: str = ""


@dataclass
class RunResult:
    scenario_name: str
    scenario_file: str
    scenario_echo: JsonDict
    tool_version: str
    started_at: float
    finished_at: float
    interrupted: str | None                    # None, "SIGINT" or "SIGTERM"
    phases: list[PhaseResult]
    checks: list[Check]
    faults: list[FaultRecord]
    target: JsonDict
    telemetry: JsonDict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    exit_code: int = 0
    failure: str | None = None                 # the run could not start, or stopped on an error
    timeline: list[SecondStats] = field(default_factory=list)
    cdfs: list[Cdf] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)   # host, python, scenario hash
    trend: list[TrendPoint] = field(default_factory=list)
    aborted: str | None = None                 # the abort condition that held, as a sentence
    load_processes: list[JsonDict] = field(default_factory=list)   # Locust workers (run/workers.py)
    judged: list[JudgedFault] = field(default_factory=list)   # each fault step's before/after
    recovery_times: list[RecoveryTime] = field(default_factory=list)   # per judged fault
    steps_form: bool = False                   # the scenario gave ``steps:`` (not ``phases:``)

    @property
    def broken(self) -> list[Check]:
        """Gating checks that ran and failed; a check whose phase never ran is not broken."""
        return [c for c in self.checks if c.gating and c.ran and not c.passed]

    @property
    def not_judged(self) -> list[Check]:
        """Gating checks left unjudged, the load generator being saturated, that the scenario
        neither fails nor lets pass (``verdicts.saturated``'s default): exit code 6 when
        nothing broke."""
        return [c for c in self.checks if c.gating and c.ran and c.passed and c.not_judged]

    def to_dict(self) -> JsonDict:
        return asdict(self)
