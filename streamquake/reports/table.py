"""The verdict grid and phase summary as plain rows, shared by the terminal and Markdown."""

from __future__ import annotations

from dataclasses import dataclass

from streamquake.errors import EXIT_NOT_JUDGED
from streamquake.jsontypes import JsonDict
from streamquake.metric_catalog import CATALOG, METRICS, RATE_METRICS
from streamquake.reports.phrasing import pairs, value_text
from streamquake.result import Check, FaultRecord, RunResult

PHASE_COLUMNS = ("baseline", "fault", "recovery")
# The phase summary's layout: rows of its own (counts, shares, the client's health) as
# (label, key, stat), and a metric's name for that metric's rows as the catalog words them.
# ``_REST``: the catalog's other metrics with rows, in its order (so a new one shows).
_REST = "(the catalog's other metrics)"
_LAYOUT: tuple[str | tuple[str, str, str | None], ...] = (
    ("requests sent", "sent", None),
    ("arrivals not sent", "not_sent", None),            # open loop only, as the two below
    "queue_delay_ms",
    "ttft_scheduled_ms",
    ("ended after its step: TTFT/end", "ended_after", None),
    ("cut off by the timeout: TTFT/end", "censored", None),
    "error_rate",
    ("cancelled by the client (share)", "cancelled", None),   # with a class's cancel
    # With a conversation class: its sessions, and TTFT of its first turn against its last.
    ("sessions done/failed/abandoned", "conversation", "sessions"),
    ("TTFT p50/p95 ms, turn 1", "conversation", "first"),
    ("TTFT p50/p95 ms, last turn", "conversation", "last"),
    ("retried attempts (not requests)", "requests_retried", None),   # with load.retries
    "send_ms",
    "dns_ms", "connect_ms", "tls_ms",                   # these three where some were measured
    "write_ms",
    "ttfb_ms",
    "ttft_ms",
    "ttfa_ms",                                          # these three where streams had
    ("reasoning events", "reasoning", "events"),        # reasoning or tool calls
    ("tool-call argument events", "tool_calls", "events"),
    "itl_ms",
    ("ITL gaps sharing a stamp", "shared_stamp_share", None),
    ("streams arriving in bursts", "bunching", "share"),
    "e2e_ms",
    "output_tokens_per_s",
    "stall_rate",
    ("client stalls, not the server's", "client_stalls", None),   # run/saturation.py
    "chunk_loss",
    "usage_deficit",
    ("tokens counted, no usage", "tokens_counted", None),
    _REST,
    ("client saturated", "client_saturated", None),
    ("client CPU % max", "client", "cpu_pct_max"),
    ("client hub lag p99 ms", "client", "hub_lag_p99_ms"),
    ("client hub held max ms", "client", "hub_lag_max_ms"),
    ("client own bookkeeping hold max ms", "client", "own_hold_max_ms"),
    ("client own GC pause max ms", "client", "gc_pause_max_ms"),
    ("client kernel-to-seen p99 ms", "client", "seen_gap_p99_ms"),
    ("client reads batched s", "client", "read_batched_s"),      # loadgen/batching.py
)


def _summary_rows() -> tuple[tuple[str, str, str | None], ...]:
    placed = {item for item in _LAYOUT if isinstance(item, str)}
    rest = [m.name for m in CATALOG if m.rows and m.name not in placed]
    out: list[tuple[str, str, str | None]] = []
    for item in _LAYOUT:
        if isinstance(item, tuple):
            out.append(item)
            continue
        for name in rest if item == _REST else [item]:
            out += [(label, name, stat) for label, stat in METRICS[name].rows]
    return tuple(out)


SUMMARY_METRICS = _summary_rows()


@dataclass
class Cell:
    text: str
    passed: bool | None      # None: not evaluated here
    gating: bool
    ran: bool = True         # False: the phase never ran ("not run", never a failure)
    measurable: bool = True  # False: "not measurable" here, a warning unless it gates as failed
    not_judged: bool = False  # its step's load generator was saturated: neither met nor broken
                              #   by its value (``passed`` False: verdicts.saturated: fail)


OPEN_LOOP_ROWS = frozenset({"not_sent", "queue_delay_ms", "ttft_scheduled_ms"})
NEW_CONNECTION_ROWS = frozenset({"dns_ms", "connect_ms", "tls_ms"})
ANSWER_PART_ROWS = frozenset({"ttfa_ms", "reasoning", "tool_calls"})
AT_LEAST = "≥"     # before a figure that censored values could move: a lower bound


def fmt_value(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "client_saturated":
        return "yes" if value else "no"
    if metric in RATE_METRICS or metric in ("shared_stamp_share", "bunching"):
        return f"{value * 100:.1f}%"
    if metric in ("requests", "sent", "not_sent", "client_stalls", "client_saturated_s",
                  "tokens_counted", "requests_retried", "reasoning", "tool_calls"):
        return f"{int(value)}"
    return f"{value:.1f}"


def _late_or_cut(stats: JsonDict, key: str) -> str:
    """Requests due in the step whose first token / end came after it (``ended_after``), or
    that the timeout cut off before them (``censored``): ``3/5``."""
    if key == "ended_after":
        counts = stats.get("ended_after")
        if not isinstance(counts, dict):
            return "-"
        return "/".join(str(counts.get(m, 0)) for m in ("ttft_ms", "e2e_ms"))
    parts = []
    for metric in ("ttft_ms", "e2e_ms"):
        summary = stats.get(metric)
        n = summary.get("censored", 0) if isinstance(summary, dict) else 0
        parts.append(str(n if isinstance(n, int) else 0))
    return "/".join(parts)


def _bound_mark(stats: JsonDict, metric: str, stat: str | None) -> str:
    summary = stats.get(metric)
    at_least = summary.get("at_least") if isinstance(summary, dict) else None
    return AT_LEAST if isinstance(at_least, list) and stat in at_least else ""


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
    if check.not_judged:
        seen = "" if check.observed is None else value_text(check.metric, check.observed) + " "
        return Cell(text=f"{seen}not judged", passed=check.passed, gating=check.gating,
                    not_judged=True)
    if not check.measurable:
        return Cell(text="not measurable", passed=check.passed, gating=check.gating,
                    measurable=False)
    # "?": inconclusive (words.inconclusive_legend says why, under the grid).
    mark = " ?" if check.inconclusive else ""
    seen = "-" if check.observed is None else \
        (AT_LEAST if check.at_least else "") + value_text(check.metric, check.observed)
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
        if metric in ANSWER_PART_ROWS and not _answer_parts(result):
            continue
        if metric == "requests_retried" and not _retrying(result):
            continue
        if metric == "cancelled" and not any(p.stats.get("cancelled") for p in result.phases):
            continue
        if metric == "conversation" and not any(p.stats.get(metric) for p in result.phases):
            continue
        if metric == "prompt_cache_reuse" and all(p.stats.get(metric) is None
                                                  for p in result.phases):
            continue        # a server that says nothing of its prefix cache
        cells = {}
        for phase in columns:
            stats: JsonDict = by_phase.get(phase, {})
            if metric in ("ended_after", "censored"):
                cells[phase] = _late_or_cut(stats, metric) if stats else "-"
                continue
            if metric == "cancelled":
                cells[phase] = _cancelled(stats)
                continue
            if metric == "conversation":
                cells[phase] = _conversation(_dict_of(stats.get(metric)), stat or "")
                continue
            value = stats.get(metric)
            bound = _bound_mark(stats, metric, stat) if value is not None else ""
            if stat is not None:
                value = value.get(stat) if isinstance(value, dict) else None
            text = fmt_value(metric, value if isinstance(value, int | float) else None)
            cells[phase] = bound + text if text != "-" else text
        rows.append((label, cells))
    return rows


def _conversation(conv: dict[str, object], stat: str) -> str:
    """A conversation class's cell: its sessions ``30/1/2`` (completed, failed, abandoned), or
    TTFT p50/p95 of its first or its last turn (the highest turn number measured in the step)
    ``48.2/61.0``."""
    if stat == "sessions":
        ends = _dict_of(conv.get("sessions"))
        return "/".join(str(ends.get(k, 0)) for k in ("completed", "failed", "abandoned")) \
            if ends else "-"
    turns = _dict_of(conv.get("turns"))
    if not turns:
        return "-"
    numbers = sorted(int(k) for k in turns)
    ttft = _dict_of(_dict_of(turns[str(numbers[0] if stat == "first" else numbers[-1])])
                    .get("ttft_ms"))
    p50, p95 = ttft.get("p50"), ttft.get("p95")
    if not isinstance(p50, int | float) or not isinstance(p95, int | float):
        return "-"
    return f"{p50:.1f}/{p95:.1f}"


def _cancelled(stats: JsonDict) -> str:
    """Streams the client abandoned (a class's ``cancel``) and their share of those that
    ended: ``12 (30.0%)``; neither successes nor errors."""
    n, share = stats.get("cancelled"), stats.get("cancelled_share")
    if not isinstance(n, int):
        return "-"
    return f"{n} ({share * 100:.1f}%)" if isinstance(share, int | float) else str(n)


def _retrying(result: RunResult) -> bool:
    """The load retried, or was allowed to (load.retries)."""
    load = result.scenario_echo.get("load")
    return (isinstance(load, dict) and load.get("retries") not in (None, "none")) or any(
        p.stats.get("requests_retried") for p in result.phases)


def _answer_parts(result: RunResult) -> bool:
    """Some stream had reasoning or tool-call arguments besides its text."""
    return any(_dict_of(p.stats.get(k)).get("events") for p in result.phases
               for k in ("reasoning", "tool_calls"))


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


SATURATED_WORDS = "the load generator was saturated"


def verdict_word(result: RunResult) -> str:
    """The run's last line. Timings a saturated load generator measured decide neither "SLO
    BROKEN" nor "ALL SLOs MET" (run/saturation.py): ``NOT JUDGED`` (exit 6), ``NOT JUDGED,
    FAILED`` (verdicts.saturated: fail) or ``ALL JUDGED SLOs MET`` (warn, or not gating)."""
    if result.interrupted:
        return f"INTERRUPTED ({result.interrupted})"
    if result.failure or result.exit_code not in (0, 1, EXIT_NOT_JUDGED):
        return f"RUN FAILED (exit {result.exit_code})"
    unjudged = [c for c in result.checks if c.ran and c.not_judged]
    n = f"{len(unjudged)} check{'s' if len(unjudged) != 1 else ''}"
    if result.broken and all(c.not_judged for c in result.broken):
        return f"NOT JUDGED, FAILED: {SATURATED_WORDS} ({n}; verdicts.saturated: fail)"
    if result.broken:
        return "SLO BROKEN" + (f" ({n} not judged: {SATURATED_WORDS})" if unjudged else "")
    if result.not_judged:
        return f"NOT JUDGED: {SATURATED_WORDS} ({n} not judged; nothing judged broke)"
    if unjudged:
        return f"ALL JUDGED SLOs MET ({n} not judged: {SATURATED_WORDS})"
    return "ALL SLOs MET"


def verdict_tone(result: RunResult) -> str:
    """``ok`` (all met), ``warn`` (met as far as judged, or not judged) or ``bad``."""
    word = verdict_word(result)
    if word == "ALL SLOs MET":
        return "ok"
    return "warn" if word.startswith(("ALL JUDGED", "NOT JUDGED:")) else "bad"


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
        word = ("not run" if not c.ran else "not judged" if c.not_judged else
                "not gating" if not c.gating else
                "not measurable" if not c.measurable else "met" if c.passed else "broken")
        counts[word] = counts.get(word, 0) + 1
    order = ("met", "broken", "not judged", "not measurable", "not gating", "not run")
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


def fault_settings(f: FaultRecord) -> str:
    """A fault's settings as the scenario writes them (``drop=15%, first_event_delay=400ms``),
    as the terminal says them; the internal form (``drop=0.15 first_event_delay_ms=400``)
    only for a record that has no such text."""
    return f.settings or pairs(f.configured, skip=("type", "name", "phase"))


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
