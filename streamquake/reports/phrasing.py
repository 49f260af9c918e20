"""How every report words a check, a value, a fault's settings and a time: one place, so the
terminal, summary.md, junit.xml and report.html say the same thing the same way."""

from __future__ import annotations

import datetime

from streamquake.jsontypes import JsonValue
from streamquake.metric_catalog import METRICS, RATE_METRICS, unit_text
from streamquake.result import Check, FaultRecord, PhaseResult, RecoveryTime, RunResult

COUNT_METRICS = ("requests", "sent", "not_sent")


def unit(metric: str) -> str:
    """A catalog metric's unit (nothing for a rate: a percentage); else what its name ends in:
    the stats' own figures (``hub_lag_p99_ms``, ``client_saturated_s``)."""
    if metric in METRICS:
        return unit_text(metric)
    if metric.endswith("_ms"):
        return " ms"
    if metric == "client_saturated_s":   # seconds
        return " s"
    return ""


def value_text(metric: str, value: float | None) -> str:
    """A measured value with its unit: ``552.8 ms``, ``1.2%``, ``240``; ``no data`` for None."""
    if value is None:
        return "no data"
    if metric in RATE_METRICS:
        return f"{value * 100:.2f}%" if 0 < abs(value) < 0.001 else f"{value * 100:.1f}%"
    if metric in COUNT_METRICS:
        return f"{int(value)}"
    return f"{value:.1f}{unit(metric)}"


def metric_label(check: Check) -> str:
    p = f" p{check.percentile:g}" if check.percentile is not None else ""
    return f"{check.metric}{p}"


def state(check: Check) -> str:
    """``met``, ``broken``, ``not run`` (its phase never started), ``not judged`` (its step's
    load generator was saturated), ``not measurable`` (this target or load cannot give the
    metric) or ``no data``."""
    if not check.ran:
        return "not run"
    if check.not_judged:
        return "not judged"
    if not check.measurable:
        return "not measurable"
    if check.observed is None:
        return "no data"
    return "met" if check.passed else "broken"


def _limit(check: Check) -> str:
    words = "at most" if check.op == "<=" else "at least"
    return f"{words} {value_text(check.metric, check.threshold)}"


def _margin(check: Check) -> str:
    if check.observed is None or check.threshold != check.threshold:   # NaN: no threshold
        return ""
    gap = abs(check.observed - check.threshold)
    word = "over" if check.op == "<=" else "short"
    rel = f", {gap / abs(check.threshold) * 100:.0f}%" if check.threshold else ""
    if check.metric in RATE_METRICS:
        return f" ({word} by {gap * 100:.2f} points{rel})"
    return f" ({word} by {gap:.1f}{unit(check.metric)}{rel})"


def evidence(check: Check) -> str:
    """How many values stand behind a check and how sure it is: ``n=269, 95% CI 150.2 ms to
    160.1 ms``, ``n=1606, worth 127 independent, ...`` when they depend on each other; a
    side that so few values cannot bound says so."""
    if check.samples is None or check.confidence is None:
        return ""

    def side(v: float | None, what: str) -> str:
        return f"unbounded {what}" if v is None else value_text(check.metric, v)

    conf = f"{check.confidence * 100:g}%"
    worth = check.effective_samples
    n = f"n={check.samples}" + (f", worth {worth} independent"
                                if worth is not None and worth < check.samples else "")
    text = f"{n}, {conf} CI {side(check.ci_low, 'below')} to {side(check.ci_high, 'above')}"
    if check.inconclusive:
        text += ("; inconclusive: that interval reaches both sides of the limit"
                 if check.ci_low is not None and check.ci_high is not None
                 else "; inconclusive: too few values to bound it on the limit's side")
    return text


def inconclusive_legend(checks: list[Check]) -> str | None:
    """The line under a verdict grid that shows ``?``: what it means and why each one is, with
    the count of values a percentile that too few values bound would need."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for c in checks:
        if not (c.inconclusive and c.ran and c.measurable and c.observed is not None
                and not c.not_judged):
            continue
        conf = f"{(c.confidence or 0.95) * 100:g}%"
        why = (f"p{c.percentile:g} needs at least {c.samples_needed} values to be bounded"
               if c.samples_needed is not None and c.percentile is not None else
               f"its {conf} confidence interval reaches both sides of the limit")
        worth = c.effective_samples
        n = f"n={c.samples}" + (f", worth {worth} independent"
                                if worth is not None and c.samples and worth < c.samples else "")
        label = metric_label(c) + (f" [{c.cls}]" if c.cls else "")
        where = reasons.setdefault((label, why), [])
        if f"{c.phase} ({n})" not in where:     # an SLO and a recovery check on one value
            where.append(f"{c.phase} ({n})")
    if not reasons:
        return None
    return "? inconclusive, more values could turn the verdict: " + "; ".join(
        f"{label} in {', '.join(where)}: {why}" for (label, why), where in reasons.items())


NOT_GATING_LEGEND = "(value ✓/✗): measured and met/broken, but not gating in that step"


def not_judged_gate(check: Check) -> str:
    """How a check that was not judged gates (the scenario's ``verdicts.saturated``)."""
    if not check.passed:
        return "the scenario's verdicts.saturated: fail makes that a failure"
    if not check.gating:
        return "not gating"
    return ("the run exits 6 unless something broke (verdicts.saturated: fail or warn "
            "decides otherwise)")


def not_judged_legend(checks: list[Check]) -> str | None:
    """The line under a verdict grid that shows ``not judged``: which checks, each saturated
    step's reason once (run/saturation.py words it ``the load generator was saturated (step N
    of M s: why; ...)``), and how they gate."""
    where: dict[str, list[str]] = {}
    steps: dict[str, None] = {}
    gates: dict[str, None] = {}
    for c in checks:
        if not c.not_judged or not c.ran:
            continue
        label = (c.name if c.kind == "recovery" else metric_label(c)) + (
            f" [{c.cls}]" if c.cls else "")
        if c.phase not in (phases := where.setdefault(label, [])):
            phases.append(c.phase)
        head, _, inner = c.not_judged.partition(" (")
        for step in inner.removesuffix(")").split("; ") if inner else [head]:
            steps[step] = None
        if c.gating or not c.passed:
            gates[not_judged_gate(c)] = None
    if not where:
        return None
    return ("not judged, the load generator being saturated (its timings are the client's as "
            "much as the server's): " + "; ".join(f"{label} in {', '.join(p)}"
                                                  for label, p in where.items())
            + ". Saturated: " + "; ".join(steps) + "." + "".join(f" {g[0].upper()}{g[1:]}."
                                                               for g in gates))


def recovery_time_lines(result: RunResult, step: str | None = None) -> list[str]:
    """``time to recovery after slow (in back): came back after 2.9 s (2.6-3.4 s at 95%; window
    of 72 requests, 12.0 s)``, for each judged fault (or the one fault step ``step``)."""
    return [recovery_time_text(rt) for rt in result.recovery_times
            if step is None or rt.step == step]


def recovery_time_text(rt: RecoveryTime) -> str:
    return f"time to recovery after {rt.step} (in {rt.after}): {rt.text}"


def recovery_basis(check: Check) -> str | None:
    """A recovery check's comparison with the counts and intervals behind both sides: ``itl_ms
    p95 recovers to baseline +50% (met): after f-slow: base1 24.5 (n=1016, ...); rec1 ...``."""
    if check.kind != "recovery" or not check.detail or not check.ran:
        return None
    return f"{check.name} ({state(check)}): {check.detail}"


def sentence(check: Check, skipped: frozenset[str] = frozenset()) -> str:
    """What happened, for a reader: the observation first, then the limit, then the gap.
    ``skipped``: the fault steps an abort skipped (their checks, and the recovery checks that
    judge them, were not run for that reason).

    ``ttft_ms p95 was 552.8 ms in fault; the SLO allows at most 350.0 ms (over by 202.8 ms, 58%)``
    """
    where = f"{check.phase}" + (f" [{check.cls}]" if check.cls else "")
    what = metric_label(check)
    rule = "recovery allows" if check.kind == "recovery" else "the SLO allows"
    if check.op == ">=":
        rule = rule.replace("allows", "needs")
    basis = f"; {check.detail}" if check.detail and check.kind == "recovery" else ""
    if not check.ran and (step := check.judges if check.judges in skipped else
                          check.phase if check.phase in skipped else None):
        return f"not run: the run aborted before fault step {step}, so it ran without its faults"
    if not check.ran:
        return f"not run: the run stopped before the {check.phase} phase began"
    if check.not_judged:
        seen = "no value" if check.observed is None else value_text(check.metric,
                                                                     check.observed)
        limit = "" if check.threshold != check.threshold else f" against {_limit(check)}"
        return (f"not judged: {check.not_judged}; {what} in {where} measured {seen}{limit}; "
                f"{not_judged_gate(check)}")
    if not check.measurable:
        reason = check.detail.removeprefix("not measurable").lstrip(": ")
        gates = "" if check.passed else \
            "; the scenario's verdicts.unmeasurable: fail makes that a failure"
        return f"{what} is not measurable in {where}: {reason}{gates}"
    if check.observed is None and check.metric == "recovery_time_s":
        return f"{what}: {check.detail} in {where}, so " + (
            f"it is unknown whether it meets {_limit(check)}" if check.inconclusive else
            f"it cannot meet {_limit(check)}")
    if check.observed is None:
        why = check.detail.removeprefix("no data: ") or "nothing in this phase measured it"
        return f"{what}: no data in {where} ({why}), so it cannot meet {_limit(check)}"
    if check.threshold != check.threshold:
        return f"{what} was {value_text(check.metric, check.observed)} in {where}{basis}"
    seen = ("at least " if check.at_least else "") + value_text(check.metric, check.observed)
    text = f"{what} was {seen} in {where}; {rule} {_limit(check)}"
    if not check.passed:
        text += _margin(check)
    sure = evidence(check)
    return text + (f" [{sure}]" if sure else "") + basis


def flat(value: JsonValue, prefix: str = "") -> list[tuple[str, str]]:
    """A nested JSON value as ``(dotted.key, text)`` pairs, in order, nothing cut."""
    if isinstance(value, dict):
        out: list[tuple[str, str]] = []
        for k, v in value.items():
            out += flat(v, f"{prefix}.{k}" if prefix else k)
        return out
    if isinstance(value, list):
        if all(not isinstance(v, dict | list) for v in value):
            return [(prefix, "[" + ", ".join(_scalar(v) for v in value) + "]")]
        out = []
        for i, v in enumerate(value):
            out += flat(v, f"{prefix}[{i}]")
        return out
    return [(prefix, _scalar(value))]


def _scalar(value: JsonValue) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def pairs(value: JsonValue, skip: tuple[str, ...] = ()) -> str:
    """``key=value key=value`` on one line, every key kept (``skip`` drops exact keys)."""
    if value is None:
        return ""
    return " ".join(f"{k}={v}" for k, v in flat(value) if k not in skip)


def when(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def run_t0(result: RunResult) -> float:
    """The origin of every report's time axis: the first phase's start (else the run's)."""
    return result.phases[0].start if result.phases else result.started_at


def phase_status(result: RunResult) -> dict[str, PhaseResult]:
    return {p.name: p for p in result.phases}


def skipped_steps(result: RunResult) -> frozenset[str]:
    """The fault steps an abort skipped (run without their faults)."""
    return frozenset(p.name for p in result.phases if p.status == "skipped")


def target_text(result: RunResult) -> str:
    t = result.target
    kind, url = t.get("kind"), t.get("url")
    proto = result.scenario_echo.get("target")
    protocol = proto.get("protocol") if isinstance(proto, dict) else None
    if url is None and isinstance(proto, dict):
        url = proto.get("url")     # a run that never started: the URL it was given
    text = f"{'embedded ' if kind == 'embedded' else ''}{protocol or ''} target"
    if isinstance(url, str):
        text += f" at {url}"
    if isinstance(t.get("load_url"), str):
        text += f" (load through {t['load_url']})"
    return text.strip()


def interruption(result: RunResult) -> str | None:
    """One sentence on how the run ended early, if it did."""
    if result.failure and not result.phases:
        return f"the run could not start: {result.failure}"
    stopped = [p for p in result.phases if p.status == "partial"]
    not_run = [p.name for p in result.phases if p.status == "not run"]
    if not (result.interrupted or result.failure):
        return None
    cause = f"interrupted by {result.interrupted}" if result.interrupted else \
        f"stopped on an error: {result.failure}"
    where = f" during {stopped[0].name}" if stopped else ""
    rest = f"; not run: {', '.join(not_run)}" if not_run else ""
    return f"{cause}{where}{rest}"


def class_reading(result: RunResult) -> dict[str, str]:
    """How each slow-consumer class read its streams (``load.classes[].read``), by class name:
    ``reads at most 2.0 kB/s, pauses 200 ms every 10 events, receive buffer 4096 B``."""
    load = result.scenario_echo.get("load")
    classes = load.get("classes") if isinstance(load, dict) else None
    out: dict[str, str] = {}
    for c in classes if isinstance(classes, list) else []:
        read = c.get("read") if isinstance(c, dict) else None
        if not isinstance(c, dict) or not isinstance(read, dict):
            continue
        parts = []
        if isinstance(rate := read.get("rate"), int | float):
            parts.append(f"reads at most {rate / 1000:g} kB/s")
        if isinstance(pause := read.get("pause"), int | float) and pause:
            parts.append(f"pauses {pause * 1000:g} ms every {read.get('every')} events")
        if isinstance(buf := read.get("receive_buffer"), int):
            parts.append(f"receive buffer {buf} B")
        out[str(c.get("name"))] = ", ".join(parts)
    return out


def _state_value(fault: FaultRecord, state: str, metric: str, stat: str | None) -> str:
    got = fault.states.get(state, {}).get(metric)
    value = got.get(stat) if isinstance(got, dict) and stat else got
    return value_text(metric, value if isinstance(value, int | float) else None)


def flap_text(fault: FaultRecord) -> str | None:
    """A flapping fault in a line: its on-edges, time on, and its effect on vs off."""
    if not fault.edges:
        return None
    ons = sum(e.state == "on" for e in fault.edges)
    on_s, off_s = (fault.states.get(s, {}).get("seconds") for s in ("on", "off"))
    text = f"flapped on {ons} times"
    if isinstance(on_s, int | float) and isinstance(off_s, int | float):
        text += f", on {on_s:.1f} s of {on_s + off_s:.1f} s"
    if "requests" in fault.states.get("on", {}):
        text += "; on / off: " + ", ".join(
            f"{label} {_state_value(fault, 'on', m, st)} / {_state_value(fault, 'off', m, st)}"
            for label, m, st in (("TTFT p95", "ttft_ms", "p95"), ("errors", "error_rate", None)))
    return text
