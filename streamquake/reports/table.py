"""The verdict grid and phase summary as plain rows, shared by the terminal and Markdown."""

from __future__ import annotations

from dataclasses import dataclass

from streamquake.jsontypes import JsonDict
from streamquake.reports.phrasing import value_text
from streamquake.result import Check, FaultRecord, RunResult

PHASE_COLUMNS = ("baseline", "fault", "recovery")
SUMMARY_METRICS = (
    ("requests sent", "sent", None),
    ("arrivals not sent", "not_sent", None),            # open loop only, as the two below
    ("queue delay p95 ms", "queue_delay_ms", "p95"),
    ("TTFT p95 from schedule ms", "ttft_scheduled_ms", "p95"),
    ("not attributed: TTFB/TTFT/ITL/end", "unattributed", None),
    ("errors", "error_rate", None),
    ("retried attempts (not requests)", "requests_retried", None),   # with load.retries
    ("send p95 ms (connect + write)", "send_ms", "p95"),
    ("send: DNS p95 ms", "dns_ms", "p95"),              # these three where some were measured
    ("send: connect p95 ms", "connect_ms", "p95"),
    ("send: TLS handshake p95 ms", "tls_ms", "p95"),
    ("send: write p95 ms", "write_ms", "p95"),
    ("TTFB p95 ms", "ttfb_ms", "p95"),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p95 ms", "ttft_ms", "p95"),
    ("ITL p50 ms", "itl_ms", "p50"),
    ("ITL p95 ms", "itl_ms", "p95"),
    ("ITL gaps sharing a stamp", "shared_stamp_share", None),
    ("streams arriving in bursts", "bunching", "share"),
    ("E2E p95 ms", "e2e_ms", "p95"),
    ("tokens/s p50", "output_tokens_per_s", "p50"),
    ("stall rate", "stall_rate", None),
    ("client stalls, not the server's", "client_stalls", None),   # run/saturation.py
    ("chunk loss", "chunk_loss", None),
    ("usage tokens not seen as events", "usage_deficit", None),
    ("tokens counted, no usage", "tokens_counted", None),
    ("client saturated", "client_saturated", None),
    ("client CPU % max", "client", "cpu_pct_max"),
    ("client hub lag p99 ms", "client", "hub_lag_p99_ms"),
    ("client hub held max ms", "client", "hub_lag_max_ms"),
    ("client own bookkeeping hold max ms", "client", "own_hold_max_ms"),
    ("client own GC pause max ms", "client", "gc_pause_max_ms"),
    ("client kernel-to-seen p99 ms", "client", "seen_gap_p99_ms"),
)


@dataclass
class Cell:
    text: str
    passed: bool | None      # None: not evaluated here
    gating: bool
    ran: bool = True         # False: the phase never ran ("not run", never a failure)
    measurable: bool = True  # False: "not measurable" here, a warning unless it gates as failed


OPEN_LOOP_ROWS = frozenset({"not_sent", "queue_delay_ms", "ttft_scheduled_ms"})
NEW_CONNECTION_ROWS = frozenset({"dns_ms", "connect_ms", "tls_ms"})
_UNATTRIBUTED = ("ttfb_ms", "ttft_ms", "itl_ms", "e2e_ms")   # loadgen/metrics.py UNATTRIBUTED


def fmt_value(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "client_saturated":
        return "yes" if value else "no"
    if metric in ("error_rate", "stall_rate", "chunk_loss", "not_sent_rate", "usage_deficit",
                  "shared_stamp_share", "bunching"):
        return f"{value * 100:.1f}%"
    if metric in ("requests", "sent", "not_sent", "client_stalls", "client_saturated_s",
                  "tokens_counted", "requests_retried"):
        return f"{int(value)}"
    return f"{value:.1f}"


def _unattributed(stats: JsonDict) -> str:
    counts = stats.get("unattributed")
    if not isinstance(counts, dict):
        return "-"
    return "/".join(str(counts.get(m, 0)) for m in _UNATTRIBUTED)


def _open_loop(result: RunResult) -> bool:
    for p in result.phases:
        queue = p.stats.get("queue_delay_ms")
        if p.stats.get("not_sent") or (isinstance(queue, dict) and queue.get("count")):
            return True
    return False


def verdict_rows(result: RunResult, checks: list[Check] | None = None
                 ) -> list[tuple[str, dict[str, Cell]]]:
    rows: dict[str, dict[str, Cell]] = {}
    for check in result.checks if checks is None else checks:
        label = check.name + (f" [{check.cls}]" if check.cls else "")
        rows.setdefault(label, {})[check.phase] = _cell(check)
    return list(rows.items())


def _cell(check: Check) -> Cell:
    if not check.ran:
        return Cell(text="not run", passed=None, gating=check.gating, ran=False)
    if not check.measurable:
        return Cell(text="not measurable", passed=check.passed, gating=check.gating,
                    measurable=False)
    # "?": inconclusive (words.inconclusive_legend says why, under the grid).
    mark = " ?" if check.inconclusive else ""
    seen = "-" if check.observed is None else value_text(check.metric, check.observed)
    return Cell(text=seen + mark, passed=check.passed, gating=check.gating)


def summary_rows(result: RunResult, columns: tuple[str, ...] = PHASE_COLUMNS
                 ) -> list[tuple[str, dict[str, str]]]:
    by_phase = {p.name: p.stats for p in result.phases}
    open_loop = _open_loop(result)
    rows = []
    for label, metric, stat in SUMMARY_METRICS:
        if metric in OPEN_LOOP_ROWS and not open_loop:
            continue
        if metric in NEW_CONNECTION_ROWS and not any(
                _dict_of(p.stats.get(metric)).get("count") for p in result.phases):
            continue
        if metric == "requests_retried" and not _retrying(result):
            continue
        cells = {}
        for phase in columns:
            stats: JsonDict = by_phase.get(phase, {})
            if metric == "unattributed":
                cells[phase] = _unattributed(stats) if stats else "-"
                continue
            value = stats.get(metric)
            if stat is not None:
                value = value.get(stat) if isinstance(value, dict) else None
            cells[phase] = fmt_value(metric, value if isinstance(value, int | float) else None)
        rows.append((label, cells))
    return rows


def _retrying(result: RunResult) -> bool:
    """The load retried, or was allowed to (load.retries)."""
    load = result.scenario_echo.get("load")
    return (isinstance(load, dict) and load.get("retries") not in (None, "none")) or any(
        p.stats.get("requests_retried") for p in result.phases)


def _dict_of(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def status_row(result: RunResult, columns: tuple[str, ...] = PHASE_COLUMNS) -> dict[str, str]:
    """Each phase: complete, partial (the run stopped in it), not run, skipped (a fault step
    after an abort), or "-" (not planned)."""
    by_phase = {p.name: p for p in result.phases}
    return {p: by_phase[p].status if p in by_phase else "-" for p in columns}


def error_rows(result: RunResult, columns: tuple[str, ...] = PHASE_COLUMNS
               ) -> list[tuple[str, dict[str, str]]]:
    """Failed requests by kind and phase (kinds with no failure anywhere are left out), then
    those that failed after their phase ended (counted in no phase's errors, never unsaid)."""
    counts: dict[str, dict[str, int]] = {}
    for key, suffix in (("errors", ""), ("late_errors", ", ended after its phase")):
        for phase in result.phases:
            errors = phase.stats.get(key)
            if isinstance(errors, dict):
                for kind, n in errors.items():
                    if isinstance(n, int) and n > 0:
                        counts.setdefault(kind + suffix, {})[phase.name] = n
    status = status_row(result, columns)
    return [(kind, {p: "-" if status[p] in ("-", "not run") else str(c.get(p, 0))
                    for p in columns}) for kind, c in counts.items()]


def top_reasons(result: RunResult, limit: int = 5) -> list[str]:
    """Why requests failed, most frequent first, over the measured phases: ``HTTP 404: Not
    Found x39 (http_status; baseline 13, fault 13, recovery 13)``."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for phase in result.phases:
        reasons = phase.stats.get("error_reasons")
        for kind, by_reason in (reasons.items() if isinstance(reasons, dict) else ()):
            for reason, n in (by_reason.items() if isinstance(by_reason, dict) else ()):
                if isinstance(n, int) and n > 0:
                    per = counts.setdefault((str(kind), str(reason)), {})
                    per[phase.name] = per.get(phase.name, 0) + n
    ranked = sorted(counts.items(), key=lambda kv: -sum(kv[1].values()))
    lines = []
    for (kind, reason), per in ranked[:limit]:
        where = ", ".join(f"{p} {n}" for p, n in per.items())
        lines.append(f"{reason} x{sum(per.values())} ({kind}; {where})")
    if len(ranked) > limit:
        rest = sum(sum(per.values()) for _, per in ranked[limit:])
        lines.append(f"{len(ranked) - limit} other reason(s) x{rest} (report.json: "
                     "error_reasons)")
    return lines


def verdict_word(result: RunResult) -> str:
    if result.interrupted:
        return f"INTERRUPTED ({result.interrupted})"
    if result.failure or result.exit_code not in (0, 1):
        return f"RUN FAILED (exit {result.exit_code})"
    return "SLO BROKEN" if result.broken else "ALL SLOs MET"


# Steps form (``result.steps_form``): an overview of the timeline, then one block per judged
# fault step with the steps it is judged against, so each table stays narrow (80 columns).
ROLES = ("before", "during", "after")


@dataclass
class FaultBlock:
    """A fault step as the reports show it: its baseline before, itself, its recovery after
    (``""`` where the timeline has none), and the checks that speak of it: the SLOs in those
    three steps and the recovery checks that judge it."""

    step: str
    faults: list[str]
    columns: tuple[str, ...]
    checks: list[Check]

    @property
    def title(self) -> str:
        before, during, after = (c or "none" for c in self.columns)
        which = f"fault{'s' if len(self.faults) != 1 else ''} {', '.join(self.faults)}"
        return (f"fault step {self.step} ({which}): before {before} / during {during} / "
                f"after {after}")


def fault_blocks(result: RunResult) -> list[FaultBlock]:
    blocks = []
    for j in result.judged:
        columns = (j.before or "", j.step, j.after or "")
        checks = [c for c in result.checks if c.judges == j.step
                  or (c.kind != "recovery" and c.phase and c.phase in columns)]
        blocks.append(FaultBlock(j.step, list(j.faults), columns, checks))
    return blocks


def unblocked_checks(result: RunResult, blocks: list[FaultBlock]) -> list[Check]:
    """The checks no fault block shows (a step that judges no fault step), in run order."""
    shown = {id(c) for b in blocks for c in b.checks}
    return [c for c in result.checks if id(c) not in shown]


def verdict_counts(checks: list[Check]) -> str:
    """``2 met, 1 broken``: a step's checks by state (not gating ones apart); ``-``: none."""
    counts: dict[str, int] = {}
    for c in checks:
        word = ("not run" if not c.ran else "not gating" if not c.gating else
                "not measurable" if not c.measurable else "met" if c.passed else "broken")
        counts[word] = counts.get(word, 0) + 1
    order = ("met", "broken", "not measurable", "not gating", "not run")
    return ", ".join(f"{counts[w]} {w}" for w in order if w in counts) or "-"


def step_rows(result: RunResult) -> list[tuple[str, str, str, str, str, str, str]]:
    """The timeline overview: step, kind, faults, duration, status, requests sent, SLOs."""
    rows = []
    for p in result.phases:
        sent = p.stats.get("sent")
        rows.append((p.name, p.kind, ", ".join(p.faults) or "-",
                     f"{max(0.0, p.end - p.start):g} s", p.status,
                     fmt_value("sent", sent if isinstance(sent, int | float) else None),
                     verdict_counts([c for c in result.checks if c.phase == p.name])))
    return rows


def step_fault_records(result: RunResult, step: str) -> list[FaultRecord]:
    """The fault records in force in ``step``: applied before it ended and not reverted before
    it began (a fault held across consecutive steps is in each), or, never applied, planned
    for it."""
    p = next((p for p in result.phases if p.name == step), None)
    if p is None:
        return []
    return [f for f in result.faults if f.name in p.faults and (
        f.phase == step if f.applied_at is None else
        f.applied_at < p.end and (f.reverted_at is None or f.reverted_at > p.start))]


def record_step(result: RunResult, fault: FaultRecord) -> str:
    """The step a fault record was applied in (a fault that several steps apply apart has a
    record each), else the step it was planned for."""
    return next((p.name for p in result.phases if fault.applied_at is not None
                 and p.start <= fault.applied_at < p.end), fault.phase)
