"""``streamquake capacity``'s outputs: the terminal tables, capacity.json, summary.md, and
report.html with a throughput-vs-latency and a goodput chart per condition. Renders the search's
result; computes nothing the search did not (run/capacity_search.py, run/goodput.py)."""

from __future__ import annotations

import dataclasses
import json
from html import escape
from pathlib import Path

from rich.console import Console
from rich.markup import escape as rich_escape
from rich.table import Table

from streamquake.jsontypes import JsonDict
from streamquake.reports import svg
from streamquake.reports.html import CSS
from streamquake.reports.terminal import print_table
from streamquake.run.capacity_search import (
    CapacityResult,
    Condition,
    Probe,
    value_text,
)
from streamquake.run.goodput import KNEE_SHARE

VERDICT_COLORS = {"pass": "#2ca02c", "fail": "#d62728", "inconclusive": "#b9770e"}


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}/s"


def _goodput(probe: Probe) -> str:
    return "-" if probe.goodput is None else probe.goodput.text


KNEE_RULE = (f"knee: the highest probed rate up to which every probed rate kept at least "
             f"{KNEE_SHARE:.0%} of its requests as goodput")


def _value(probe: Probe) -> str:
    c = probe.checks[0] if probe.checks else None
    if c is None or c.observed is None:
        return "-"
    # value_text: not 3.47e-18 for a bound at 0 (rounding's dust)
    ci = f" [{value_text(c.ci_low)}, {value_text(c.ci_high)}]" if c.ci_low is not None else ""
    return f"{value_text(c.observed)}{ci}"


def print_capacity(result: CapacityResult, console: Console) -> None:
    summary = Table(title=f"{result.scenario_name}: capacity (SLOs: {result.metric_note})",
                    title_justify="left")
    for col in ("condition", "capacity", "bracket", "knee", "how sure", "stopped"):
        summary.add_column(col, overflow="fold")
    for c in result.conditions:
        summary.add_row(rich_escape(c.name), _rate(c.estimate),
                        f"[{_rate(c.low)}, {_rate(c.high)}]", rich_escape(c.knee.short),
                        rich_escape(c.sureness(result.confidence)), rich_escape(c.stopped))
    print_table(summary, console)
    for c in result.conditions:
        probes = Table(title=f"{c.name}: probes", title_justify="left")
        for col in ("rate", "sent/s", "answered/s", "goodput", "SLO value [CI]", "verdict"):
            probes.add_column(col, justify="right")
        for p in c.probes:
            probes.add_row(_rate(p.rate), f"{p.sent_per_s:.3g}",
                           "-" if p.answered_per_s is None else f"{p.answered_per_s:.3g}",
                           _goodput(p), _value(p), p.verdict)
        print_table(probes, console)
    console.print(f"goodput: the requests due in a probe's measured step that "
                  f"{result.goodput_rule}; {KNEE_RULE}", markup=False, highlight=False,
                  soft_wrap=True)
    for loss in result.losses:
        console.print(f"capacity under {loss.text}", markup=False, highlight=False,
                      soft_wrap=True)
    if result.interrupted:
        console.print(f"interrupted ({result.interrupted}): the search stopped there",
                      markup=False, highlight=False)


def capacity_json(result: CapacityResult) -> JsonDict:
    conditions: list[JsonDict] = [
        {**dataclasses.asdict(c), "low": c.low, "high": c.high, "estimate": c.estimate,
         "sureness": c.sureness(result.confidence),
         "knee": {"rate": c.knee.rate, "above": c.knee.above, "text": c.knee.text}}
        for c in result.conditions]
    doc: JsonDict = {
        "scenario_name": result.scenario_name, "scenario_file": result.scenario_file,
        "slos": result.metric_note, "confidence": result.confidence,
        "precision": result.precision, "started_at": result.started_at,
        "finished_at": result.finished_at, "interrupted": result.interrupted,
        "goodput": {"rule": result.goodput_rule, "knee_share": KNEE_SHARE},
        "conditions": conditions,   # type: ignore[dict-item]
        "losses": [{**dataclasses.asdict(loss), "text": loss.text}
                   for loss in result.losses],
    }
    return doc


def _chart(c: Condition, index: int) -> str:
    """The rate sent against the first SLO's value, one point a probe in order of rate,
    coloured by verdict; the threshold dashed. (On answered/s, a probe whose every request
    failed sat at 0 and the curve ran backwards.)"""
    probes = sorted((p for p in c.probes if p.checks and p.checks[0].observed is not None),
                    key=lambda p: p.rate)
    if not probes:
        return f"<p>{escape(c.name)}: no probe measured a value to chart.</p>"
    first = probes[0].checks[0]
    x = [p.sent_per_s for p in probes]
    points = [(xv, p.checks[0].observed) for xv, p in zip(x, probes, strict=True)]
    top = max(max(x), 1e-9) * 1.1
    lines = [svg.Line(first.name, svg.PALETTE["p95"], points),
             svg.Line("threshold", "#7f7f7f", [(0.0, first.threshold), (top, first.threshold)],
                      dash=True)]
    marks = [svg.Mark(xv, p.checks[0].observed or 0.0,
                      f"{p.rate:.3g}/s asked: {p.verdict}: {p.why}", VERDICT_COLORS[p.verdict])
             for xv, p in zip(x, probes, strict=True)]
    chart = svg.Chart(f"capacity-{index}", f"{c.name}: throughput vs {first.metric}", lines,
                      "requests/s sent", first.name, x_max=svg.nice(top), marks=marks,
                      height=230)
    return svg.render(chart)


def _goodput_chart(c: Condition, index: int) -> str:
    """Goodput/s against the rate offered, one point a probe; what every request and what
    the knee's share of them would make dashed; the knee a vertical line."""
    probes = sorted((p for p in c.probes if p.goodput is not None), key=lambda p: p.rate)
    if not probes:
        return f"<p>{escape(c.name)}: no probe measured goodput (load.samples is none).</p>"
    top = svg.nice(max(p.rate for p in probes) * 1.1)
    lines = [svg.Line("goodput/s", svg.PALETTE["baseline"],
                      [(p.rate, p.goodput.per_s if p.goodput else None) for p in probes]),
             svg.Line("offered", "#7f7f7f", [(0.0, 0.0), (top, top)], dash=True),
             svg.Line(f"{KNEE_SHARE:.0%} of offered", svg.PALETTE["p95"],
                      [(0.0, 0.0), (top, KNEE_SHARE * top)], dash=True)]
    marks = [svg.Mark(p.rate, p.goodput.per_s, f"{p.rate:.3g}/s asked: goodput "
                      f"{p.goodput.text}; {p.verdict}", VERDICT_COLORS[p.verdict])
             for p in probes if p.goodput is not None]
    knee = c.knee.rate
    chart = svg.Chart(f"goodput-{index}", f"{c.name}: goodput (knee {c.knee.short})", lines,
                      "requests/s offered", "requests/s meeting every SLO",
                      x_max=top, y_max=top, marks=marks,
                      edges=[(knee, "knee")] if knee is not None else [], height=230)
    return svg.render(chart)


def render_capacity_html(result: CapacityResult) -> str:
    rows = "".join(
        f"<tr><td>{escape(c.name)}</td><td>{_rate(c.estimate)}</td>"
        f"<td>[{_rate(c.low)}, {_rate(c.high)}]</td><td>{escape(c.knee.short)}</td>"
        f'<td class="l">{escape(c.sureness(result.confidence))}</td>'
        f'<td class="l">{escape(c.stopped)}</td></tr>' for c in result.conditions)
    losses = "".join(f"<li>{escape(loss.text)}</li>" for loss in result.losses)
    charts = "".join(_chart(c, i) + _goodput_chart(c, i)
                     for i, c in enumerate(result.conditions))
    probes = "".join(
        f"<h3>{escape(c.name)}</h3><table><tr><th>rate</th><th>sent/s</th><th>answered/s</th>"
        "<th>goodput</th><th>SLO value [CI]</th><th>verdict</th><th>why</th></tr>" + "".join(
            f"<tr><td>{_rate(p.rate)}</td><td>{p.sent_per_s:.3g}</td>"
            f"<td>{'-' if p.answered_per_s is None else f'{p.answered_per_s:.3g}'}</td>"
            f"<td>{escape(_goodput(p))}</td>"
            f"<td>{escape(_value(p))}</td><td>{p.verdict}</td>"
            f'<td class="l">{escape(p.why)}</td></tr>' for p in c.probes) + "</table>"
        for c in result.conditions)
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>"
            f"streamquake capacity: {escape(result.scenario_name)}</title><style>{CSS}</style>"
            f"</head><body><h1>{escape(result.scenario_name)}: capacity under fault</h1>"
            f"<p class=\"meta\">the highest arrival rate at which the SLOs hold "
            f"({escape(result.metric_note)}); each probe's verdict at "
            f"{result.confidence:.0%} confidence; goodput: the requests due in a probe's "
            f"measured step that {escape(result.goodput_rule)}; {escape(KNEE_RULE)}</p>"
            f"<table><tr><th>condition</th><th>capacity</th><th>bracket</th><th>knee</th>"
            f"<th>how sure</th><th>stopped</th></tr>{rows}</table>"
            + (f"<h2>Capacity left by each fault</h2><ul>{losses}</ul>" if losses else "")
            + f"<h2>Throughput vs latency, and goodput</h2>{charts}<h2>Probes</h2>{probes}"
            "</body></html>\n")


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_capacity_markdown(result: CapacityResult) -> str:
    """summary.md: the capacities and knees first, then each condition's probes."""
    lines = [f"## {_md(result.scenario_name)}: capacity under fault", "",
             f"The highest arrival rate at which the SLOs hold ({_md(result.metric_note)}), "
             f"each probe's verdict at {result.confidence:.0%} confidence.", "",
             "| condition | capacity | bracket | knee | how sure | stopped |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {_md(c.name)} | {_rate(c.estimate)} | [{_rate(c.low)}, {_rate(c.high)}] | "
              f"{_md(c.knee.short)} | {_md(c.sureness(result.confidence))} | "
              f"{_md(c.stopped)} |" for c in result.conditions]
    lines += ["", *(f"- capacity under {_md(loss.text)}" for loss in result.losses)]
    lines += ["", f"Goodput: the requests due in a probe's measured step that "
              f"{_md(result.goodput_rule)}; {KNEE_RULE}.", ""]
    for c in result.conditions:
        lines += [f"### {_md(c.name)}", "", f"Knee: {_md(c.knee.text)}.", "",
                  "| rate | sent/s | goodput | SLO value [CI] | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {_rate(p.rate)} | {p.sent_per_s:.3g} | {_md(_goodput(p))} | "
                  f"{_md(_value(p))} | {p.verdict} |" for p in c.probes]
        lines.append("")
    if result.interrupted:
        lines += [f"Interrupted ({_md(result.interrupted)}): the search stopped there.", ""]
    return "\n".join(lines)


def write_capacity_reports(result: CapacityResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    doc, md, html = out / "capacity.json", out / "summary.md", out / "report.html"
    doc.write_text(json.dumps(capacity_json(result), indent=2) + "\n", encoding="utf-8")
    md.write_text(render_capacity_markdown(result), encoding="utf-8")
    html.write_text(render_capacity_html(result), encoding="utf-8")
    return [doc, md, html]
