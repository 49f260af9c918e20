"""``streamquake capacity``'s outputs: the terminal tables, capacity.json, and report.html with
a throughput-vs-latency chart per condition. Renders the search's result; computes nothing the
search did not (run/capacity_search.py)."""

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
    SearchPlan,
    search_capacity,
)
from streamquake.scenario import parse_scenario

VERDICT_COLORS = {"pass": "#2ca02c", "fail": "#d62728", "inconclusive": "#b9770e"}


def search_and_report(scenario_file: Path, text: bytes, overrides: list[str], out: Path,
                      plan: SearchPlan, console: Console) -> int:
    """Search, print, write; the process's exit code (the probe runs' own when interrupted)."""
    scenario = parse_scenario(text, str(scenario_file), overrides)
    result = search_capacity(scenario, str(scenario_file), out, plan,
                             lambda line: console.print(line, markup=False, highlight=False,
                                                        soft_wrap=True))
    print_capacity(result, console)
    for path in write_capacity_reports(result, out):
        console.print(f"wrote {path}", highlight=False)
    return result.exit_code


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}/s"


def _value(probe: Probe) -> str:
    c = probe.checks[0] if probe.checks else None
    if c is None or c.observed is None:
        return "-"
    ci = f" [{c.ci_low:.3g}, {'?' if c.ci_high is None else f'{c.ci_high:.3g}'}]" \
        if c.ci_low is not None else ""
    return f"{c.observed:.3g}{ci}"


def print_capacity(result: CapacityResult, console: Console) -> None:
    summary = Table(title=f"{result.scenario_name}: capacity (SLOs: {result.metric_note})",
                    title_justify="left")
    for col in ("condition", "capacity", "bracket", "how sure", "stopped"):
        summary.add_column(col, overflow="fold")
    for c in result.conditions:
        summary.add_row(rich_escape(c.name), _rate(c.estimate),
                        f"[{_rate(c.low)}, {_rate(c.high)}]",
                        rich_escape(c.sureness(result.confidence)), rich_escape(c.stopped))
    print_table(summary, console)
    for c in result.conditions:
        probes = Table(title=f"{c.name}: probes", title_justify="left")
        for col in ("rate", "sent/s", "answered/s", "SLO value [CI]", "verdict"):
            probes.add_column(col, justify="right")
        for p in c.probes:
            probes.add_row(_rate(p.rate), f"{p.sent_per_s:.3g}",
                           "-" if p.answered_per_s is None else f"{p.answered_per_s:.3g}",
                           _value(p), p.verdict)
        print_table(probes, console)
    for loss in result.losses:
        console.print(f"capacity under {loss.text}", markup=False, highlight=False,
                      soft_wrap=True)
    if result.interrupted:
        console.print(f"interrupted ({result.interrupted}): the search stopped there",
                      markup=False, highlight=False)


def capacity_json(result: CapacityResult) -> JsonDict:
    conditions: list[JsonDict] = [
        {**dataclasses.asdict(c), "low": c.low, "high": c.high, "estimate": c.estimate,
         "sureness": c.sureness(result.confidence)} for c in result.conditions]
    doc: JsonDict = {
        "scenario_name": result.scenario_name, "scenario_file": result.scenario_file,
        "slos": result.metric_note, "confidence": result.confidence,
        "precision": result.precision, "started_at": result.started_at,
        "finished_at": result.finished_at, "interrupted": result.interrupted,
        "conditions": conditions,   # type: ignore[dict-item]
        "losses": [{**dataclasses.asdict(loss), "text": loss.text}
                   for loss in result.losses],
    }
    return doc


def _chart(c: Condition, index: int) -> str:
    """Throughput (answered/s; sent/s where no samples were written) against the first SLO's
    value, one point a probe in order of rate, coloured by verdict; the threshold dashed."""
    probes = sorted((p for p in c.probes if p.checks and p.checks[0].observed is not None),
                    key=lambda p: p.rate)
    if not probes:
        return f"<p>{escape(c.name)}: no probe measured a value to chart.</p>"
    first = probes[0].checks[0]
    x = [p.answered_per_s if p.answered_per_s is not None else p.sent_per_s for p in probes]
    points = [(xv, p.checks[0].observed) for xv, p in zip(x, probes, strict=True)]
    top = max(max(x), 1e-9) * 1.1
    lines = [svg.Line(first.name, svg.PALETTE["p95"], points),
             svg.Line("threshold", "#7f7f7f", [(0.0, first.threshold), (top, first.threshold)],
                      dash=True)]
    marks = [svg.Mark(xv, p.checks[0].observed or 0.0,
                      f"{p.rate:.3g}/s asked: {p.verdict}: {p.why}", VERDICT_COLORS[p.verdict])
             for xv, p in zip(x, probes, strict=True)]
    answered = all(p.answered_per_s is not None for p in probes)
    chart = svg.Chart(f"capacity-{index}", f"{c.name}: throughput vs {first.metric}", lines,
                      "answered requests/s" if answered else "sent requests/s (no samples)",
                      first.name, x_max=svg.nice(top), marks=marks, height=230)
    return svg.render(chart)


def render_capacity_html(result: CapacityResult) -> str:
    rows = "".join(
        f"<tr><td>{escape(c.name)}</td><td>{_rate(c.estimate)}</td>"
        f"<td>[{_rate(c.low)}, {_rate(c.high)}]</td>"
        f'<td class="l">{escape(c.sureness(result.confidence))}</td>'
        f'<td class="l">{escape(c.stopped)}</td></tr>' for c in result.conditions)
    losses = "".join(f"<li>{escape(loss.text)}</li>" for loss in result.losses)
    charts = "".join(_chart(c, i) for i, c in enumerate(result.conditions))
    probes = "".join(
        f"<h3>{escape(c.name)}</h3><table><tr><th>rate</th><th>sent/s</th><th>answered/s</th>"
        "<th>SLO value [CI]</th><th>verdict</th><th>why</th></tr>" + "".join(
            f"<tr><td>{_rate(p.rate)}</td><td>{p.sent_per_s:.3g}</td>"
            f"<td>{'-' if p.answered_per_s is None else f'{p.answered_per_s:.3g}'}</td>"
            f"<td>{escape(_value(p))}</td><td>{p.verdict}</td>"
            f'<td class="l">{escape(p.why)}</td></tr>' for p in c.probes) + "</table>"
        for c in result.conditions)
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>"
            f"streamquake capacity: {escape(result.scenario_name)}</title><style>{CSS}</style>"
            f"</head><body><h1>{escape(result.scenario_name)}: capacity under fault</h1>"
            f"<p class=\"meta\">the highest arrival rate at which the SLOs hold "
            f"({escape(result.metric_note)}); each probe's verdict at "
            f"{result.confidence:.0%} confidence</p>"
            f"<table><tr><th>condition</th><th>capacity</th><th>bracket</th><th>how sure</th>"
            f"<th>stopped</th></tr>{rows}</table>"
            + (f"<h2>Capacity left by each fault</h2><ul>{losses}</ul>" if losses else "")
            + f"<h2>Throughput vs latency</h2>{charts}<h2>Probes</h2>{probes}</body></html>\n")


def write_capacity_reports(result: CapacityResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    doc, html = out / "capacity.json", out / "report.html"
    doc.write_text(json.dumps(capacity_json(result), indent=2) + "\n", encoding="utf-8")
    html.write_text(render_capacity_html(result), encoding="utf-8")
    return [doc, html]
