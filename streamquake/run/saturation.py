"""Was the load generator keeping up? The runner's side of the saturation guard.

Each load process writes one line a second to ``saturation-<pid>.jsonl`` in the run directory
(``loadgen/self_measure.py``). A second is *saturated*, its timings distorted, when any of:

* the process used at least :data:`CPU_PCT` % of one core (a gevent process has one);
* the gevent hub woke at least :data:`HUB_LAG_P90_MS` ms late on a tenth of its probes (p90):
  every greenlet, each socket read among them, waited that long, whatever the CPU figure says
  (two processes sharing one core each stay near 50%);
* a tenth of its events (p90, in a second with at least :data:`SEEN_MIN_EVENTS`) were seen
  :data:`SEEN_P90_MS` ms or more after the kernel received them;
* the hub was held :data:`HUB_HOLD_MS` ms or more at once, or for :data:`FROZEN_SHARE` of the
  second in holds of :data:`FROZEN_LAG_MS` ms or more: a periodic freeze (a heavy checkpoint
  every 2 s, say) moves no p90, yet every event that comes during it is dated late;
* its own bookkeeping (``loadgen/holds.py``) held the hub for more than 10 ms of CPU time in
  one go.

Why p90 and not p99: on a shared 2-core VM an idle load process (4 streams, 5% CPU) already
shows kernel-to-seen p99 of 2-5 ms and hub-lag maxima of 1-10 ms in some seconds (wake-up
latency, other processes); a tenth of a second's readings 10 ms late has not been noise there.

A phase is ``client_saturated`` when at least a tenth of its seconds (and at least one) were:
the live view says so once per phase as soon as that holds, and every report shows the phase's
figures. With ``load.saturation: fail`` a saturated measured phase also breaks the gate.

The harness's own trouble is never the service's: in a saturated measured step no *timing*
decides a verdict (:meth:`SaturationGuard.leave_unjudged`, after the verdicts are evaluated).
Each timing check there (a percentile SLO, ``stall_rate``, ``recovery_time_s``, a recovery
comparison whose baseline or recovery step is saturated) is *not judged*, with the guard's
reason, and gates as the scenario's ``verdicts.saturated``: ``not_judged`` (exit 6 when nothing
broke), ``fail`` or ``warn``. Errors and counts (``error_rate``, ``not_sent_rate``,
``chunk_loss``, ``usage_deficit``) are still judged: a late reader sees a failed request fail
and a missing chunk missing. ``stall_rate`` is a timing: a stall is a gap over a time limit,
and the split of a gap into the client's own lateness and the server's is exact only for reads
the kernel stamped, an estimate from the hub's lag for the rest.

The thresholds sit far from both sides measured here (docs/measurement.md, "the saturation
guard"): a process keeping up (5-46% CPU, up to 9,000 events/s) shows hub lag p90 <= 2.5 ms and
kernel-to-seen p90 <= 0.5 ms; a saturated one (90-99% CPU, or sharing its core at far less)
hub-lag medians of 2-175 ms and kernel-to-seen medians of 3-300 ms.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from streamquake.jsontypes import JsonDict
from streamquake.loadgen.histogram import SparseHistogram
from streamquake.loadgen.holds import GC_FULL, GC_KINDS
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.self_measure import FILE_PREFIX, bucket_ms
from streamquake.loadgen.tail import new_lines
from streamquake.metric_catalog import RECOVERY_TIME, TIMING_METRICS
from streamquake.result import Check, JudgedFault, PhaseResult
from streamquake.run.events import Events
from streamquake.run.timeline import PhaseWindow
from streamquake.stats import counts_percentile, percentile

CPU_PCT = 90.0
HUB_LAG_P90_MS = 10.0
HUB_HOLD_MS = 50.0
FROZEN_LAG_MS = 10.0
FROZEN_SHARE = 0.05
SEEN_P90_MS = 10.0
SEEN_MIN_EVENTS = 100
PHASE_SHARE = 0.10
MEASURED = ("baseline", "fault", "recovery")      # step kinds (warmup is not measured)
CHECK_NAME = "load generator not saturated"
CHECK_METRIC = "client_saturated_s"
# TIMING_METRICS (the metric catalog's ``timing``) are what a saturated load generator distorts:
# every time it measures. A stall is a gap over a time limit, so stall_rate is one; the other
# rates are counts, which a late reader still counts right.
NOT_JUDGED = "the load generator was saturated"


def _hist_rank(hist: dict[int, int], p: float) -> float | None:
    bucket = counts_percentile(hist, p)
    return None if bucket is None else bucket_ms(bucket)


@dataclass(frozen=True)
class LoadSecond:
    """One second of one load process, as it measured itself."""

    pid: int
    start: float
    end: float
    cpu_pct: float
    lag_ms: list[float]
    seen: dict[int, int]          # kernel-to-seen gap: log bucket -> events
    seen_max_ms: float
    kernel_reads: int
    user_reads: int
    # kind -> [holds, longest wall ms, longest CPU ms, total wall ms, holds over 10 ms CPU]
    holds: dict[str, list[float]] = field(default_factory=dict)
    gc_max_ms: float = 0.0        # the longest garbage collection of the second, wall ms
    in_flight: int | None = None  # requests sent and not ended, at the second's end
    read_batch_ms: float = 0.0    # the read batching's interval over the second (0: off)

    @classmethod
    def from_dict(cls, d: JsonDict) -> LoadSecond:
        lag, seen, holds = d.get("lag_ms"), d.get("seen"), d.get("holds")
        return cls(
            pid=int(str(d["pid"])), start=float(str(d["start"])), end=float(str(d["end"])),
            cpu_pct=float(str(d["cpu_pct"])),
            lag_ms=sorted(float(str(v)) for v in lag) if isinstance(lag, list) else [],
            seen={int(k): int(str(v)) for k, v in seen.items()} if isinstance(seen, dict) else {},
            seen_max_ms=float(str(d.get("seen_max_ms", 0.0))),
            kernel_reads=int(str(d.get("kernel_reads", 0))),
            user_reads=int(str(d.get("user_reads", 0))),
            holds={str(k): [float(str(x)) for x in v][:5] for k, v in holds.items()
                   if isinstance(v, list) and len(v) >= 5} if isinstance(holds, dict) else {},
            gc_max_ms=float(str(d.get("gc_max_ms", 0.0))),
            in_flight=int(str(d["in_flight"])) if d.get("in_flight") is not None else None,
            read_batch_ms=float(str(d.get("read_batch_ms", 0.0))),
        )

    @property
    def frozen_share(self) -> float:
        """The share of this second the hub spent in holds of FROZEN_LAG_MS or more."""
        frozen = sum(v for v in self.lag_ms if v >= FROZEN_LAG_MS)
        return frozen / max(1.0, (self.end - self.start) * 1000.0)

    @property
    def mid(self) -> float:
        return (self.start + self.end) / 2.0

    @property
    def seen_events(self) -> int:
        return sum(self.seen.values())

    def reasons(self) -> list[str]:
        """Why this second's timings are distorted; empty when they are not."""
        out = []
        if self.cpu_pct >= CPU_PCT:
            out.append(f"CPU {self.cpu_pct:.0f}% of a core")
        lag = percentile(self.lag_ms, 90)   # sorted when read
        if lag is not None and lag >= HUB_LAG_P90_MS:
            out.append(f"hub lag p90 {lag:.1f} ms")
        seen = _hist_rank(self.seen, 90)
        if seen is not None and self.seen_events >= SEEN_MIN_EVENTS and seen >= SEEN_P90_MS:
            out.append(f"kernel-to-seen p90 {seen:.1f} ms")
        if self.lag_ms and self.lag_ms[-1] >= HUB_HOLD_MS:
            own_gc = (f" (its own garbage collector held it {self.gc_max_ms:.0f} ms)"
                      if self.gc_max_ms >= FROZEN_LAG_MS else "")
            out.append(f"hub held {self.lag_ms[-1]:.0f} ms at once{own_gc}")
        if (share := self.frozen_share) >= FROZEN_SHARE:
            out.append(f"hub frozen {share:.0%} of the second")
        for kind, (_n, _wall, cpu, _total, over) in sorted(self.holds.items()):
            if over:
                what = "garbage collector" if kind in GC_KINDS else kind.replace("_", " ")
                out.append(f"its own {what} held the hub {cpu:.0f} ms")
        return out


class SaturationTail:
    """Reads the per-second lines every load process appends: complete lines only, once."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[LoadSecond]:
        new: list[LoadSecond] = []
        for line in new_lines(self.run_dir, f"{FILE_PREFIX}*.jsonl", self._offsets):
            try:
                data = json.loads(line)
                if isinstance(data, dict):
                    new.append(LoadSecond.from_dict(data))
            except (ValueError, TypeError, KeyError):
                continue
        return new


IN_FLIGHT_FRESH_S = 3.0    # a process's in-flight count older than this is not shown


def needed_seconds(seconds: float) -> int:
    """Saturated seconds that make a phase of ``seconds`` saturated."""
    return max(1, math.ceil(PHASE_SHARE * seconds))


@dataclass
class _Phase:
    """A phase's seconds, folded in as they come: the guard's memory does not grow with the
    run (a second of every load process would otherwise be kept)."""

    window: PhaseWindow
    saturated: set[int] = field(default_factory=set)      # whole seconds after the phase start
    warned: bool = False
    count: int = 0                                        # seconds of all processes seen
    whole: set[int] = field(default_factory=set)          # distinct whole seconds seen
    lags: SparseHistogram = field(default_factory=SparseHistogram)   # hub lag, us
    lag_max_ms: float | None = None
    seen: dict[int, int] = field(default_factory=dict)    # kernel-to-seen log buckets
    seen_max_ms: float | None = None
    cpu: dict[int, tuple[float, int]] = field(default_factory=dict)  # pid -> (sum %, seconds)
    cpu_max: float | None = None
    kernel_reads: int = 0
    user_reads: int = 0
    frozen_share_max: float | None = None
    holds: dict[str, list[float]] = field(default_factory=dict)   # as LoadSecond.holds
    gc_max_ms: float | None = None
    batched: int = 0                                      # seconds with reads batched
    batch_ms: float = 0.0                                 # ... at this interval at most
    reasons: list[str] = field(default_factory=list)      # the first saturated second's

    def add(self, second: LoadSecond) -> None:
        self.count += 1
        self.whole.add(int(second.mid))
        for lag in second.lag_ms:
            self.lags.record(round(lag * 1000.0))
        if second.lag_ms:
            self.lag_max_ms = max(self.lag_max_ms or 0.0, second.lag_ms[-1])
        for b, n in second.seen.items():
            self.seen[b] = self.seen.get(b, 0) + n
        self.seen_max_ms = max(self.seen_max_ms or 0.0, second.seen_max_ms)
        total, n = self.cpu.get(second.pid, (0.0, 0))
        self.cpu[second.pid] = (total + second.cpu_pct, n + 1)
        self.cpu_max = max(self.cpu_max or 0.0, second.cpu_pct)
        self.kernel_reads += second.kernel_reads
        self.user_reads += second.user_reads
        self.frozen_share_max = max(self.frozen_share_max or 0.0, second.frozen_share)
        self.gc_max_ms = max(self.gc_max_ms or 0.0, second.gc_max_ms)
        if second.read_batch_ms > 0:
            self.batched += 1
            self.batch_ms = max(self.batch_ms, second.read_batch_ms)
        for kind, (holds, wall, cpu, spent, over) in second.holds.items():
            k = self.holds.setdefault(kind, [0.0, 0.0, 0.0, 0.0, 0.0])
            k[0] += holds
            k[1] = max(k[1], wall)
            k[2] = max(k[2], cpu)
            k[3] += spent
            k[4] += over


class SaturationGuard:
    """Feeds on the load processes' seconds while the run lasts and marks phases after it."""

    def __init__(self, run_dir: Path, windows: list[PhaseWindow], events: Events,
                 kinds: Mapping[str, str] | None = None) -> None:
        self.tail = SaturationTail(run_dir)
        self.events = events
        self._phases = [_Phase(w) for w in windows]
        self._kinds = dict(kinds or {})     # step name -> kind (a phase is named as its kind)
        self.distorted: dict[str, str] = {}  # saturated measured step -> why (after mark)
        self._in_flight: dict[int, tuple[float, int]] = {}   # pid -> (second's end, count)

    def _measured(self, name: str) -> bool:
        return self._kinds.get(name, name) in MEASURED

    def in_flight(self, now: float) -> int | None:
        """Requests sent and not ended, over every load process that said so within the last
        few seconds (None: none did)."""
        fresh = [n for end, n in self._in_flight.values() if now - end <= IN_FLIGHT_FRESH_S]
        return sum(fresh) if fresh else None

    def poll(self) -> None:
        for second in self.tail.poll():
            if second.in_flight is not None:
                self._in_flight[second.pid] = (second.end, second.in_flight)
            phase = next((p for p in self._phases
                          if p.window.start <= second.mid < p.window.end), None)
            if phase is None:
                continue
            phase.add(second)
            reasons = second.reasons()
            if not reasons:
                continue
            phase.saturated.add(int(second.mid - phase.window.start))
            if not phase.reasons:
                phase.reasons = reasons
            need = needed_seconds(phase.window.end - phase.window.start)
            if self._measured(phase.window.name) and not phase.warned and \
                    len(phase.saturated) >= need:
                phase.warned = True
                self.events.message(
                    f"warning: the load generator is saturated in {phase.window.name} "
                    f"({len(phase.saturated)} s so far; pid {second.pid}: "
                    f"{', '.join(reasons)}): its timings are distorted; give it more cores "
                    "(load.workers) or fewer streams")

    def mark(self, phases: list[PhaseResult], stats: Mapping[str, Stats],
             fail: bool) -> tuple[list[str], list[Check]]:
        """Add each phase's figures to its stats (``client_saturated``, ``client``); return
        the warnings for saturated measured phases, and with ``fail`` a gating check each."""
        self.poll()
        by_name = {p.window.name: p for p in self._phases}
        warnings: list[str] = []
        checks: list[Check] = []
        for result in phases:
            phase = by_name.get(result.name)
            if phase is None:
                continue
            figures = _figures(phase, stats.get(result.name))
            result.stats["client_saturated"] = bool(figures["saturated"])
            result.stats["client_stalls"] = figures["client_stalls"]
            result.stats["client"] = figures
            if not self._measured(result.name) or not phase.count:
                continue
            if figures["saturated"]:
                warnings.append(_warning(result.name, figures))
                self.distorted[result.name] = (
                    f"{result.name} {figures['saturated_s']} of {figures['seconds']} s: "
                    + ", ".join(phase.reasons))
            if fail:
                need = needed_seconds(phase.window.end - phase.window.start)
                checks.append(Check(
                    name=CHECK_NAME, kind="client", phase=result.name, metric=CHECK_METRIC,
                    op="<=", threshold=float(need - 1), observed=float(len(phase.saturated)),
                    passed=not figures["saturated"], gating=True,
                    detail=_warning(result.name, figures) if figures["saturated"] else ""))
        return warnings, checks

    def leave_unjudged(self, checks: list[Check], judged: list[JudgedFault],
                       policy: str) -> None:
        """After :meth:`mark` and the verdicts: each timing check whose step (a recovery
        comparison's, or time to recovery's: its baseline step too) was saturated is not
        judged, and gates as ``policy`` (``verdicts.saturated``): ``not_judged`` lets it pass
        and the run exit 6 (``RunResult.not_judged``), ``fail`` fails it, ``warn`` makes it
        not gating. A check with no data (no request succeeded) or not measurable is left as
        it is: that is not the client's lateness. Mutates ``checks``."""
        if not self.distorted:
            return
        before = {j.step: j.before for j in judged}
        for check in checks:
            if not _timing(check) or not check.ran or not check.measurable or (
                    check.observed is None and check.metric != RECOVERY_TIME):
                continue
            steps = [check.phase]
            if check.kind == "recovery" or check.metric == RECOVERY_TIME:
                steps.append(before.get(check.judges or "", "baseline") or "")
            why = [self.distorted[s] for s in dict.fromkeys(steps) if s in self.distorted]
            if not why:
                continue
            check.not_judged = f"{NOT_JUDGED} ({'; '.join(why)})"
            check.inconclusive = False
            check.samples_needed = None
            check.passed = policy != "fail"
            if policy == "warn":
                check.gating = False


def _timing(check: Check) -> bool:
    return check.kind == "recovery" or (check.kind == "slo" and check.metric in TIMING_METRICS)


def _figures(phase: _Phase, stats: Stats | None) -> JsonDict:
    busiest = max((total / n for total, n in phase.cpu.values()), default=None)
    reads = phase.kernel_reads + phase.user_reads
    need = needed_seconds(phase.window.end - phase.window.start)

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    def lag(p: float) -> float | None:
        # Nearest rank over every probe of the phase, to the histogram's 4 digits.
        us = phase.lags.percentile(p)
        return None if us is None else us / 1000.0

    return {
        "saturated": bool(phase.count) and len(phase.saturated) >= need,
        "saturated_s": len(phase.saturated),
        "seconds": len(phase.whole),
        "processes": len(phase.cpu),
        "cpu_pct": r(busiest),
        "cpu_pct_max": r(phase.cpu_max),
        "hub_lag_p50_ms": r(lag(50)),
        "hub_lag_p99_ms": r(lag(99)),
        "hub_lag_max_ms": r(phase.lag_max_ms),
        "seen_gap_p50_ms": r(_hist_rank(phase.seen, 50)),
        "seen_gap_p99_ms": r(_hist_rank(phase.seen, 99)),
        "seen_gap_max_ms": r(phase.seen_max_ms),
        "kernel_timed_reads": round(phase.kernel_reads / reads, 4) if reads else None,
        "hub_frozen_share_max": r(phase.frozen_share_max),
        "own_hold_max_ms": r(max((k[1] for k in phase.holds.values()), default=None)),
        # The longest pause of the load processes' own garbage collector, and its full ones.
        "gc_pause_max_ms": r(phase.gc_max_ms),
        "gc_full_collections": int(phase.holds.get(GC_FULL, [0.0])[0]),
        # How long the load processes' own bookkeeping held the hub, per kind of work.
        "own_holds": {kind: {"holds": int(n), "max_ms": r(wall), "max_cpu_ms": r(cpu),
                             "total_ms": r(total), "over_10ms_cpu": int(over)}
                      for kind, (n, wall, cpu, total, over) in sorted(phase.holds.items())},
        # Seconds (of all load processes) whose reads were batched (loadgen/batching.py),
        # and the longest interval: times our code took at a socket wait's end (a connect,
        # a read without a kernel stamp) may be that much late in them.
        "read_batched_s": phase.batched,
        "read_batch_ms": r(phase.batch_ms) if phase.batched else None,
        "client_stalls": 0 if stats is None else stats.client_stalls,
        "server_stalls": 0 if stats is None else stats.stalls,
    }


def _warning(phase: str, f: JsonDict) -> str:
    def ms(key: str) -> str:
        v = f.get(key)
        return "-" if not isinstance(v, int | float) else f"{v:.1f} ms"

    cpu = f.get("cpu_pct_max")
    cpu_text = "-" if not isinstance(cpu, int | float) else f"{cpu:.0f}%"
    gc_ms = f.get("gc_pause_max_ms")
    gc_text = (f", its own garbage collector held the hub up to {gc_ms:.0f} ms"
               if isinstance(gc_ms, int | float) and gc_ms >= FROZEN_LAG_MS else "")
    return (f"phase {phase}: the load generator was saturated for {f['saturated_s']} of "
            f"{f['seconds']} s (CPU up to {cpu_text} of a core, hub lag p99 "
            f"{ms('hub_lag_p99_ms')}, kernel-to-seen p99 {ms('seen_gap_p99_ms')}{gc_text}): its "
            f"timings are distorted ({f['client_stalls']} stalls were its own and are not "
            "counted as the server's); give it more cores (load.workers) or fewer streams")
