"""report.html: one self-contained page (inline CSS and SVG, no script, nothing fetched) that
renders the RunResult: verdicts, the per-second timeline with fault windows shaded, CDFs per
phase, classes, the fault ledger (injected vs read back vs observed), GPU telemetry, the trend
from the history store, and the environment. It draws what the run computed; it computes
nothing but coordinates."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.metric_catalog import METRICS, names
from streamquake.reports import svg
from streamquake.reports.phrasing import (
    class_reading,
    duration,
    evidence,
    flap_text,
    inconclusive_legend,
    interruption,
    not_judged_legend,
    pairs,
    recovery_basis,
    recovery_time_lines,
    run_t0,
    sentence,
    skipped_steps,
    target_text,
    value_text,
    when,
)
from streamquake.reports.table import (
    PHASE_COLUMNS,
    ROLES,
    Cell,
    FaultBlock,
    error_rows,
    fault_blocks,
    fault_settings,
    record_step,
    status_row,
    step_fault_records,
    step_rows,
    summary_rows,
    top_reasons,
    unblocked_checks,
    verdict_rows,
    verdict_tone,
    verdict_word,
)
from streamquake.result import Check, FaultRecord, PhaseResult, RunResult

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:920px;color:#222}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#555}.v{padding:2px 8px;border-radius:4px;color:#fff;font-weight:600}
.ok{background:#2a7d2a}.bad{background:#c0392b}.warn{background:#b9770e}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right;vertical-align:top}
td:first-child,th:first-child{text-align:left}.l{text-align:left}
.met{color:#2a7d2a}.broken{color:#c0392b;font-weight:700}.ng,.nr{color:#888}.nm{color:#b7791f}
.note{background:#fff6e0;border-left:4px solid #b9770e;padding:6px 10px}
code,pre{font:12px ui-monospace,monospace}pre{background:#f6f6f6;padding:8px;overflow:auto}
.kv{font:12px ui-monospace,monospace;text-align:left;overflow-wrap:break-word;max-width:340px}
svg.chart{display:block;margin:6px 0}svg .t{font:600 13px sans-serif}
svg text{font:11px sans-serif;fill:#444}svg .yl{text-anchor:end}svg .xl{text-anchor:middle}
svg .g{stroke:#eee}svg .a{stroke:#999}svg .e{stroke:#999;stroke-dasharray:2 3}
svg .band{fill:#d62728;fill-opacity:.12}svg .bl{fill:#a01c1c;font-weight:600}
svg .el{fill:#777}.cap{color:#666;font-size:12px;margin:0 0 10px}
"""

# The steps form's timeline strip, step windows and fault panels.
STEPS_CSS = """
svg .sw{fill-opacity:.07}svg .warmup{fill:#7f7f7f}svg .baseline{fill:#2ca02c}
svg .fault{fill:#d62728}svg .recovery{fill:#1f77b4}svg .skipped{fill:#bbb}
svg.strip rect{stroke:#fff}svg .st{fill-opacity:.35}svg .ld{fill:#9467bd;fill-opacity:.18}
svg .fw{fill:#d62728;fill-opacity:.55}
svg .sl{font:11px sans-serif;fill:#222}.panel{border:1px solid #ddd;border-radius:6px;
padding:4px 12px 10px;margin:14px 0}.panel h2{border:0;margin:10px 0 6px}.ev{color:#666;
font-size:11px}
"""
# Step colours for lines, in the order of the steps (CDFs, trend).
STEP_COLORS = ("#2ca02c", "#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
               "#17becf", "#bcbd22", "#7f7f7f")

TIMELINE = tuple((m, METRICS[m].title, METRICS[m].unit) for m in names(series=True))
CDF_TITLES = {m: METRICS[m].title for m in names(cdf=True)}


def _t(text: object) -> str:
    return escape(str(text))


def _num(value: JsonValue) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _dict(value: JsonValue) -> JsonDict:
    return value if isinstance(value, dict) else {}


class _Page:
    def __init__(self, result: RunResult) -> None:
        self.r = result
        self.t0 = run_t0(result)
        self.parts: list[str] = []

    def add(self, *html: str) -> None:
        self.parts.extend(html)

    def bands(self) -> list[svg.Band]:
        return [band for band, _ in _fault_windows(self)]

    def checks_at(self, checks: list[Check]) -> dict[tuple[str, str], Check]:
        """Checks by (verdict row label, step), as verdict_rows labels them."""
        return {(c.name + (f" [{c.cls}]" if c.cls else ""), c.phase): c for c in checks}

    def measured(self) -> tuple[str, ...]:
        """The phases (steps) the tables show: baseline, fault, recovery, or every step but
        the warmup ones."""
        if not self.r.steps_form:
            return PHASE_COLUMNS
        return tuple(p.name for p in self.r.phases if p.kind != "warmup")

    def color(self, phase: str) -> str:
        if not self.r.steps_form:
            return svg.PALETTE.get(phase, svg.EXTRA[0])
        names = [p.name for p in self.r.phases]
        i = names.index(phase) if phase in names else len(names)
        return STEP_COLORS[i % len(STEP_COLORS)]

    def step_bands(self) -> list[svg.Band]:
        """The steps form: each step's window, shaded by its kind (under the fault windows)."""
        if not self.r.steps_form:
            return []
        return [svg.Band(p.start - self.t0, p.end - self.t0,
                         f"step {p.name} ({p.kind}, {p.status})", f"sw {p.kind}")
                for p in self.r.phases]

    def edges(self) -> list[tuple[float, str]]:
        return [(p.start - self.t0, p.name) for p in self.r.phases]

    def x_max(self) -> float:
        return max([p.end - self.t0 for p in self.r.phases] + [len(self.r.timeline), 1.0])

    def timed(self, key: str, title: str, lines: list[svg.Line], y_label: str,
              log_when_wide: bool = False) -> str:
        """A chart on the run's time axis, with phase edges and fault windows; each its own
        y scale (a latency's log where its values span more than svg.WIDE)."""
        return svg.render(svg.Chart(key=key, title=title, lines=lines, y_label=y_label,
                                    x_label="seconds since the first phase began",
                                    bands=self.step_bands() + self.bands(), edges=self.edges(),
                                    x_max=self.x_max(), log_when_wide=log_when_wide))


def render_html(result: RunResult) -> str:
    page = _Page(result)
    _header(page)
    if result.steps_form:     # the whole timeline first, then a panel per fault step
        _steps(page)
        _timeline(page)
        _panels(page)
    else:    # the verdicts, then the charts, then the table of every figure
        _verdicts(page)
        _timeline(page)
        _measured(page)
    _cdfs(page)
    _classes(page)
    _faults(page)
    _telemetry(page)
    _trend(page)
    _environment(page)
    body = "".join(page.parts)
    title = f"streamquake: {result.scenario_name}: {verdict_word(result)}"
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{_t(title)}</title>"
            f"<style>{CSS}{STEPS_CSS if result.steps_form else ''}</style></head>"
            f"<body>{body}</body></html>\n")


def write_html(result: RunResult, path: Path) -> Path:
    path.write_text(render_html(result), encoding="utf-8")
    return path


def _header(page: _Page) -> None:
    r = page.r
    word, cls = verdict_word(r), verdict_tone(r)
    page.add(f'<h1>{_t(r.scenario_name)} <span class="v {cls}">{_t(word)}</span></h1>',
             f'<div class="meta">{_t(when(r.started_at))} · '
             f'{_t(duration(r.finished_at - r.started_at))} · exit code {r.exit_code} · '
             f'{_t(target_text(r) or "no target started")} · scenario '
             f'<code>{_t(r.scenario_file)}</code></div>')
    stopped = interruption(r)
    if stopped:
        page.add(f'<p class="note">{_t(stopped)}</p>')
    if r.errors:
        page.add('<p class="note">' + "<br>".join(_t(e) for e in r.errors) + "</p>")


def _verdicts(page: _Page) -> None:
    r = page.r
    if not r.checks:
        return
    titles = {(c.name + (f" [{c.cls}]" if c.cls else ""), c.phase): sentence(c) for c in r.checks}
    page.add("<h2>SLO verdicts</h2><table><tr><th>check</th>",
             *(f"<th>{p}</th>" for p in PHASE_COLUMNS), "</tr>")
    for label, cells in verdict_rows(r):
        page.add(f"<tr><td>{_t(label)}</td>")
        for phase in PHASE_COLUMNS:
            cell = cells.get(phase)
            tip = _t(titles.get((label, phase), ""))
            if cell is None:
                page.add("<td>-</td>")
            elif not cell.ran:
                page.add(f'<td class="nr" title="{tip}">not run</td>')
            elif cell.not_judged:
                page.add(_not_judged_cell(cell, tip))
            elif not cell.gating:
                page.add(f'<td class="ng" title="{tip}">{_t(cell.text)} '
                         f'({"met" if cell.passed else "broken"}, not gating)</td>')
            elif not cell.measurable and cell.passed:
                page.add(f'<td class="nm" title="{tip}">{_t(cell.text)} ⚠</td>')
            else:
                state = "met" if cell.passed else "broken"
                mark = "✓" if cell.passed else "✗"
                page.add(f'<td class="{state}" title="{tip}">{_t(cell.text)} {mark}</td>')
        page.add("</tr>")
    page.add("</table>")
    for legend in (inconclusive_legend(r.checks), not_judged_legend(r.checks)):
        if legend:
            page.add(f'<p class="note">{_t(legend)}</p>')
    for line in recovery_time_lines(r):
        page.add(f'<p class="note recovery-time">{_t(line)}</p>')
    broken = [c for c in r.checks if c.ran and c.gating and not c.passed]
    if broken:
        page.add("<ul>" + "".join(f"<li>{_t(sentence(c))}</li>" for c in broken) + "</ul>")


def _measured(page: _Page) -> None:
    r = page.r
    if not r.phases:
        return
    status = status_row(r)
    by_phase = {p.name: p.stats for p in r.phases}
    page.add("<h2>Measured per phase</h2><table><tr><th>metric</th>",
             *(f"<th>{p}</th>" for p in PHASE_COLUMNS), "</tr>",
             "<tr><td>phase</td>", *(f"<td>{status[p]}</td>" for p in PHASE_COLUMNS), "</tr>")
    for label, cells in summary_rows(r):
        page.add(f"<tr><td>{_t(label)}</td>",
                 *(f"<td>{_t(cells[p])}</td>" for p in PHASE_COLUMNS), "</tr>")
    for metric, label in (("ttft_ms", "TTFT values"), ("itl_ms", "ITL gaps"),
                          ("e2e_ms", "E2E values (successes)")):
        counts = [_num(_dict(by_phase.get(p, {}).get(metric)).get("count")) for p in PHASE_COLUMNS]
        page.add(f"<tr><td>{label} (n)</td>",
                 *(f"<td>{'-' if c is None else int(c)}</td>" for c in counts), "</tr>")
    for kind, cells in error_rows(r):
        page.add(f"<tr><td>{_t(kind)} errors</td>",
                 *(f"<td>{_t(cells[p])}</td>" for p in PHASE_COLUMNS), "</tr>")
    page.add("</table>")
    reasons = top_reasons(r)
    if reasons:
        page.add("<p>Why requests failed, most frequent first:</p><ul>"
                 + "".join(f"<li>{_t(reason)}</li>" for reason in reasons) + "</ul>")


# --- the steps form: the whole timeline, then a before / during / after panel per fault step ---

def _steps(page: _Page) -> None:
    r = page.r
    if not r.phases:
        return
    page.add("<h2>Timeline</h2><p class=\"cap\">Every step on the run's time axis, coloured by "
             "kind (warmup grey, baseline green, fault red, recovery blue), its load, and each "
             "fault's windows from apply to revert (a flapping fault: each on-state).</p>",
             svg.render_strip(svg.Strip(key="steps", title="Steps, load and faults",
                                        rows=_strip_rows(page), x_max=page.x_max(),
                                        x_label="seconds since the first step began")),
             "<table><tr><th>step</th><th>kind</th><th>faults</th><th>load</th><th>length</th>"
             "<th>status</th><th>requests sent</th><th>SLOs</th></tr>")
    for p, (name, kind, faults, length, status, sent, slos) in zip(r.phases, step_rows(r),
                                                                     strict=True):
        page.add(f'<tr data-step="{_t(name)}"><td>{_t(name)}</td><td class="l">{_t(kind)}</td>'
                 f'<td class="l">{_t(faults)}</td><td class="l">{_t(_load_text(r, p))}</td>'
                 f"<td>{_t(length)}</td><td class=\"l\">{_t(status)}</td><td>{_t(sent)}</td>"
                 f'<td class="l">{_t(slos)}</td></tr>')
    page.add("</table>")
    reasons = top_reasons(r)
    if reasons:
        page.add("<p>Why requests failed, most frequent first:</p><ul>"
                 + "".join(f"<li>{_t(reason)}</li>" for reason in reasons) + "</ul>")


def _panels(page: _Page) -> None:
    r = page.r
    blocks = fault_blocks(r)
    for block in blocks:
        _panel(page, block)
    rest = unblocked_checks(r, blocks)
    if rest:
        page.add("<h2>SLO verdicts in the other steps</h2><table><tr><th>check</th><th>step</th>"
                 "<th>verdict</th></tr>")
        for label, cells in verdict_rows(r, rest):
            for step, cell in cells.items():
                check = page.checks_at(rest)[(label, step)]
                page.add(f"<tr><td>{_t(label)}</td><td class=\"l\">{_t(step)}</td>"
                         f"{_verdict_cell(cell, check, skipped_steps(r))}</tr>")
        page.add("</table>")
        _notes(page, rest)


def _load_text(r: RunResult, p: PhaseResult, whose: bool = True) -> str:
    """A step's load in words: its own, or the scenario's (``users``, ``rate``, a ramp, a
    spike)."""
    own = p.load is not None
    load = p.load if p.load is not None else _dict(r.scenario_echo.get("load"))
    users, rate, spike = load.get("users"), load.get("rate"), _dict(load.get("spike"))
    if not own and rate is None:
        # The scenario's open loop has its rate in load.arrival ("1 users" was shown for a
        # 10/s scenario: its unused default users); a trace sets its own times.
        arrival = _dict(load.get("arrival"))
        rate = arrival.get("rate")
        if load.get("trace") is not None:
            return "the trace's arrivals" + (" (the scenario's)" if whose else "")
    if isinstance(rate, dict):
        text = f"{_t_num(rate.get('from'))} → {_t_num(rate.get('to'))} req/s"
    elif rate is not None:
        text = f"{_t_num(rate)} req/s"
    elif users is not None:
        text = f"{_t_num(users)} users"
    else:
        text = "-"
    if spike:
        text += (f", spike {_t_num(spike.get('rate'))} req/s at {_t_num(spike.get('at'))} s "
                 f"for {_t_num(spike.get('for'))} s")
    return text if own or not whose else f"{text} (the scenario's)"


def _t_num(value: JsonValue) -> str:
    n = _num(value)
    return "?" if n is None else f"{n:g}"


def _strip_rows(page: _Page) -> list[tuple[str, list[svg.Segment]]]:
    r, t0 = page.r, page.t0
    steps = [svg.Segment(p.start - t0, p.end - t0, p.name,
                         f"st {'skipped' if p.status == 'skipped' else p.kind}",
                         f"{p.name}: {p.kind}, {max(0.0, p.end - p.start):g} s, {p.status}"
                         + (f"; faults {', '.join(p.faults)}" if p.faults else ""))
             for p in r.phases]
    loads = [svg.Segment(p.start - t0, p.end - t0, _load_text(r, p, whose=False), "ld",
                         f"{p.name}: {_load_text(r, p)}") for p in r.phases]
    rows: list[tuple[str, list[svg.Segment]]] = [("steps", steps), ("load", loads)]
    by_name: dict[str, list[svg.Segment]] = {}
    for band, f in _fault_windows(page):
        by_name.setdefault(f.name, []).append(svg.Segment(
            band.x0, band.x1, f.type, "fw", f"{band.label}: {band.x0:.1f} s to {band.x1:.1f} s"
            + (f"; {f.error}" if f.error else ""), band.color))
    for name in dict.fromkeys(f.name for f in r.faults):
        rows.append((name, by_name.get(name, [])))
    return rows


def _fault_windows(page: _Page) -> list[tuple[svg.Band, FaultRecord]]:
    """Each fault record's windows on the time axis (a flapping one: its on-states), each
    fault in its own colour with its label on its own line, a flapping one's named on its
    first window only (the rest on hover), so no two labels overprint."""
    out = []
    names = list(dict.fromkeys(f.name for f in page.r.faults))
    for f in page.r.faults:
        if f.applied_at is None:
            continue
        k = names.index(f.name)
        color, row = svg.FAULT_COLORS[k % len(svg.FAULT_COLORS)], k
        if f.edges:
            ends = [*(e.at for e in f.edges), page.r.finished_at]
            ons = [(e.at, end) for e, end in zip(f.edges, ends[1:], strict=True)
                   if e.state == "on"]
            out += [(svg.Band(a - page.t0, b - page.t0, f"{f.name} on", color=color,
                              label_row=row, labelled=i == 0), f)
                    for i, (a, b) in enumerate(ons)]
            continue
        end = f.reverted_at if f.reverted_at is not None else page.r.finished_at
        out.append((svg.Band(f.applied_at - page.t0, end - page.t0, f"{f.name} ({f.type})",
                             color=color, label_row=row), f))
    return out


def _panel(page: _Page, b: FaultBlock) -> None:
    """One fault step: its baseline before, itself, its recovery after; values with their
    counts, the verdicts with their intervals, and the faults as applied."""
    r = page.r
    status = status_row(r, b.columns)
    page.add(f'<section class="panel" data-fault-step="{_t(b.step)}"><h2>{_t(b.title)}</h2>')
    if status[b.step] == "skipped":
        page.add('<p class="note">Skipped: the run aborted before this step, so its faults were '
                 "not applied and its checks were not run.</p>")
    head = "".join(f"<th>{role}<br><code>{_t(c or '-')}</code></th>"
                   for role, c in zip(ROLES, b.columns, strict=True))
    by_step = {p.name: p.stats for p in r.phases}
    page.add(f"<table><tr><th>measured</th>{head}</tr><tr><td>step</td>",
             *(f"<td>{_t(status[c]) if c else '-'}</td>" for c in b.columns), "</tr>")
    for label, cells in summary_rows(r, b.columns):
        page.add(f"<tr><td>{_t(label)}</td>",
                 *(f"<td>{_t(cells[c]) if c else '-'}</td>" for c in b.columns), "</tr>")
    for metric, label in (("ttft_ms", "TTFT values"), ("itl_ms", "ITL gaps"),
                          ("e2e_ms", "E2E values (successes)")):
        counts = [_num(_dict(by_step.get(c, {}).get(metric)).get("count")) for c in b.columns]
        page.add(f"<tr><td>{label} (n)</td>",
                 *(f"<td>{'-' if n is None else int(n)}</td>" for n in counts), "</tr>")
    for kind, cells in error_rows(r, b.columns):
        page.add(f"<tr><td>{_t(kind)} errors</td>",
                 *(f"<td>{_t(cells[c]) if c else '-'}</td>" for c in b.columns), "</tr>")
    page.add("</table>")
    if b.checks:
        skipped, at = skipped_steps(r), page.checks_at(b.checks)
        page.add(f"<table><tr><th>verdicts</th>{head}</tr>")
        for label, verdicts in verdict_rows(r, b.checks):
            page.add(f"<tr><td>{_t(label)}</td>")
            for c in b.columns:
                check = at.get((label, c))
                cell = verdicts.get(c) if c else None
                page.add("<td>-</td>" if cell is None or check is None else
                         _verdict_cell(cell, check, skipped))
            page.add("</tr>")
        page.add("</table>")
        _notes(page, b.checks)
    for line in recovery_time_lines(r, b.step):
        page.add(f'<p class="note recovery-time">{_t(line)}</p>')
    applied = step_fault_records(r, b.step)
    if applied:
        page.add("<ul>" + "".join(
            f"<li>fault <b>{_t(f.name)}</b> ({_t(f.type)}): "
            f"<code>{_t(fault_settings(f))}</code>, "
            + (f'<span class="broken">{_t(f.error)}</span>' if f.error else
               "applied and reverted")
            + ("" if (flapped := flap_text(f)) is None else f"; {_t(flapped)}") + "</li>"
            for f in applied) + "</ul>")
    page.add("</section>")


def _verdict_cell(cell: Cell, check: Check, skipped: frozenset[str]) -> str:
    """A verdict with its evidence (how many values, the interval) under it."""
    tip = _t(sentence(check, skipped))
    ev = evidence(check) if check.ran and check.measurable else ""
    under = f'<br><span class="ev">{_t(ev)}</span>' if ev else ""
    if not cell.ran:
        return f'<td class="nr" title="{tip}">not run</td>'
    if cell.not_judged:
        return _not_judged_cell(cell, tip)
    if not cell.gating:
        return (f'<td class="ng" title="{tip}">{_t(cell.text)} '
                f'({"met" if cell.passed else "broken"}, not gating){under}</td>')
    if not cell.measurable and cell.passed:
        return f'<td class="nm" title="{tip}">{_t(cell.text)} ⚠</td>'
    state, mark = ("met", "✓") if cell.passed else ("broken", "✗")
    return f'<td class="{state}" title="{tip}">{_t(cell.text)} {mark}{under}</td>'


def _not_judged_cell(cell: Cell, tip: str) -> str:
    """A timing its step's saturated load generator measured: neither met nor broken by it
    (``tip``, and the legend under the grid, say why and how it gates)."""
    if not cell.passed:
        return f'<td class="broken nj" title="{tip}">{_t(cell.text)} ✗</td>'
    cls = "ng nj" if not cell.gating else "nm nj"
    return f'<td class="{cls}" title="{tip}">{_t(cell.text)}</td>'


def _notes(page: _Page, checks: list[Check]) -> None:
    """Under a verdict table: what ``?`` means, the recovery checks' bases (counts and
    intervals on both sides), and each broken check in a sentence."""
    said = [legend] if (legend := inconclusive_legend(checks)) else []
    said += [legend] if (legend := not_judged_legend(checks)) else []
    said += [basis for c in checks if (basis := recovery_basis(c))]
    broken = [sentence(c, skipped_steps(page.r)) for c in checks
              if c.ran and c.gating and not c.passed]
    if said:
        page.add('<p class="cap">' + "<br>".join(_t(x) for x in said) + "</p>")
    if broken:
        page.add("<ul>" + "".join(f'<li class="broken">{_t(x)}</li>' for x in broken) + "</ul>")


def _timeline(page: _Page) -> None:
    r = page.r
    if not r.timeline:
        return
    page.add("<h2>Timeline, per second</h2><p class=\"cap\">Each request counts in the second "
             "it was sent. Percentiles are exact per second (nearest rank); a second with fewer "
             "than 20 values has its maximum as p95. Shaded: fault windows, from apply to "
             "revert (a flapping fault: each on-state). Numbers per second: timeline.csv.</p>")
    for metric, title, unit in TIMELINE:
        lines = [svg.Line(f"p{q}", svg.PALETTE[f"p{q}"],
                          [(p.t + 0.5, (p.p50 if q == 50 else p.p95).get(metric))
                           for p in r.timeline])
                 for q in (50, 95)]
        if metric == "output_tokens_per_s":
            lines = lines[:1]
        page.add(page.timed(f"timeline-{metric}", f"{title} ({unit})", lines, unit,
                            log_when_wide=unit == "ms"))
    load_lines = [
        svg.Line("sent/s", svg.PALETTE["sent"], [(p.t + 0.5, float(p.sent)) for p in r.timeline]),
        svg.Line("errors/s", svg.PALETTE["errors"],
                 [(p.t + 0.5, float(p.errors)) for p in r.timeline]),
        svg.Line("in flight", svg.PALETTE["in_flight"],
                 [(p.t + 0.5, float(p.in_flight)) for p in r.timeline], dash=True),
    ]
    page.add(page.timed("timeline-load", "Requests: sent, failed, in flight", load_lines,
                        "requests"))


def _cdfs(page: _Page) -> None:
    r = page.r
    if not r.cdfs:
        return
    word = "step" if r.steps_form else "phase"
    page.add(f"<h2>Latency distribution per {word} (CDF)</h2><p class=\"cap\">From each {word}'s "
             "HDR histogram, the same numbers the verdicts use; the x axis ends at the largest "
             "p99.5 (the maximum is in report.json).</p>")
    for metric, title in CDF_TITLES.items():
        curves = [c for c in r.cdfs if c.metric == metric and c.points]
        if not curves:
            continue
        tails = [v for c in curves for p, v in c.points if p <= 99.5]
        lines = [svg.Line(f"{c.phase} (n={c.count})", page.color(c.phase),
                          [(v, p) for p, v in c.points]) for c in curves]
        page.add(svg.render(svg.Chart(key=f"cdf-{metric}", title=f"{title} CDF", lines=lines,
                                      x_label="ms", y_label="percentile", y_max=100.0,
                                      x_max=svg.nice(max(tails, default=1.0)), height=210)))


def _classes(page: _Page) -> None:
    r = page.r
    names = sorted({c for p in r.phases for c in p.classes})
    if not names:
        return
    # A slow consumer's figures are what it saw at its own pace; the others' show what it
    # did to them.
    reading = class_reading(r)
    page.add("<h2>Per request class</h2><table><tr><th>class</th><th>reads</th><th>phase</th>"
             "<th>requests</th><th>errors</th><th>TTFT p95</th><th>ITL p95</th><th>E2E p95</th>"
             "<th>tokens/s p50</th></tr>")
    for name in names:
        for phase in r.phases:
            if phase.name not in page.measured() or name not in phase.classes:
                continue
            st = phase.classes[name]
            errors = _dict(st.get("errors"))
            n_err = sum(int(v) for v in errors.values() if isinstance(v, int))
            cells = [value_text(m, _num(_dict(st.get(m)).get(q))) for m, q in
                     (("ttft_ms", "p95"), ("itl_ms", "p95"), ("e2e_ms", "p95"),
                      ("output_tokens_per_s", "p50"))]
            page.add(f"<tr><td>{_t(name)}</td>"
                     f"<td class=\"l\">{_t(reading.get(name, 'as the stream comes'))}</td>"
                     f"<td class=\"l\">{phase.name}</td>"
                     f"<td>{_t(st.get('requests'))}</td><td>{n_err}</td>",
                     *(f"<td>{_t(c)}</td>" for c in cells), "</tr>")
    page.add("</table>")


def _observed(page: _Page, fault: FaultRecord) -> str:
    """What the client saw in the fault's phase (step), next to baseline (the baseline step
    it is judged against)."""
    stats = {p.name: p.stats for p in page.r.phases}
    phase, baseline = fault.phase, "baseline"
    if page.r.steps_form:
        phase = record_step(page.r, fault)
        baseline = next((j.before for j in page.r.judged if j.step == phase), None) or ""
    if phase not in stats:
        return "-"
    rows = []
    for metric, stat in (("ttft_ms", "p50"), ("ttft_ms", "p95"), ("itl_ms", "p95"),
                         ("e2e_ms", "p95"), ("error_rate", None), ("chunk_loss", None),
                         ("stall_rate", None)):
        def get(phase: str, m: str = metric, s: str | None = stat) -> float | None:
            v = stats.get(phase, {}).get(m)
            return _num(_dict(v).get(s)) if s else _num(v)
        label = f"{metric} {stat}" if stat else metric
        base = get(baseline) if phase != baseline else None
        there = value_text(metric, get(phase))
        rows.append(f"{label}={there}" + (f" ({baseline} {value_text(metric, base)})"
                                          if base is not None else ""))
    return "<br>".join(_t(x) for x in rows)


def _faults(page: _Page) -> None:
    r = page.r
    if not r.faults:
        return
    page.add("<h2>Fault ledger</h2><p class=\"cap\">What was injected, when, what the kernel, "
             "proxy or driver read back on apply and on revert, and what the client observed in "
             "that phase.</p><table><tr><th>fault</th><th>injected</th><th>read back on apply"
             "</th><th>read back on revert</th><th>client observed</th></tr>")
    for f in r.faults:
        at = "-" if f.applied_at is None else f"+{f.applied_at - page.t0:.1f} s"
        until = "-" if f.reverted_at is None else f"+{f.reverted_at - page.t0:.1f} s"
        err = f'<br><span class="broken">{_t(f.error)}</span>' if f.error else ""
        flapped = flap_text(f)
        err += "" if flapped is None else f"<br>{_t(flapped)}"
        step = record_step(r, f) if r.steps_form else f.phase
        page.add(f"<tr><td><b>{_t(f.name)}</b><br>{_t(f.type)}, {_t(step)}<br>"
                 f"{at} → {until}{err}</td>",
                 f'<td class="kv">{_settings(f)}</td><td class="kv">{_kv(f.applied)}</td>'
                 f'<td class="kv">{_kv(f.reverted)}</td>'
                 f'<td class="kv">{_observed(page, f)}</td></tr>')
    page.add("</table>")


def _settings(f: FaultRecord) -> str:
    """What was injected, as the scenario writes it; the full configuration as sent (netem's
    table, internal units) on hover. (Not in a closed <details> in the cell: its hidden text
    measured as broken mid-word.)"""
    said = "<br>".join(_t(x) for x in fault_settings(f).split(", "))
    return f'<span title="as sent: {_t(pairs(f.configured))}">{said}</span>'


def _kv(value: JsonValue) -> str:
    text = pairs(value)
    return "-" if not text else "<br>".join(_t(p) for p in text.split(" "))


def _telemetry(page: _Page) -> None:
    """Every resource's telemetry that says how to chart it (``faults.contract.charted``): the
    GPU family's NVML samples, or any other family's."""
    for name, value in sorted(page.r.telemetry.items()):
        report = _dict(value)
        chart = _dict(report.get("chart"))
        raw = report.get("samples")
        samples = [s for s in raw if isinstance(s, dict)] if isinstance(raw, list) else []
        listed = chart.get("charts")
        charts = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
        if not samples or not charts:
            continue
        by = chart.get("series_by")
        label = str(chart.get("series_label") or "")
        page.add(f"<h2>{_t(str(chart.get('heading') or name))}</h2>"
                 f"<p class=\"cap\">{_t(str(chart.get('caption') or ''))}</p>")
        series = sorted({str(s.get(by)) for s in samples}) if isinstance(by, str) else [""]
        for c in charts:
            field, unit = str(c.get("field")), str(c.get("unit") or "")
            lines = []
            for i, one in enumerate(series):
                pts: list[tuple[float, float | None]] = []
                for s in samples:
                    t = _num(s.get("t"))
                    if t is not None and (not isinstance(by, str) or str(s.get(by)) == one):
                        pts.append((t - page.t0, _num(s.get(field))))
                lines.append(svg.Line(f"{label} {one}".strip() or field,
                                      svg.EXTRA[i % len(svg.EXTRA)], pts))
            page.add(page.timed(f"{name}-{field}", f"{c.get('title') or field} ({unit})", lines,
                                unit))


def _trend(page: _Page) -> None:
    trend = page.r.trend
    if len(trend) < 2:
        return
    page.add("<h2>Trend: this scenario in the history store</h2><p class=\"cap\">One point per "
             "run (its id in the store), oldest first; this run is the last. Ringed: a "
             "regression by the default check of <code>streamquake history</code>.</p>",
             f"<p>{_t(trend[-1].judgement)}</p>" if trend[-1].judgement else "")
    ticks = [(i + 0.5, str(tp.run_id)) for i, tp in enumerate(trend)]
    for metric, title in (("ttft_ms", "TTFT p95"), ("itl_ms", "ITL p95"), ("e2e_ms", "E2E p95")):
        lines = [svg.Line(phase, page.color(phase),
                          [(i + 0.5, tp.values.get(f"{phase}.{metric}.p95"))
                           for i, tp in enumerate(trend)])
                 for phase in page.measured()]
        marks = [svg.Mark(i + 0.5, y, f"REGRESSION: {phase} {metric} p95 in run {tp.run_id}")
                 for i, tp in enumerate(trend) for phase in page.measured()
                 if f"{phase}.{metric}.p95" in tp.regressed
                 and (y := tp.values.get(f"{phase}.{metric}.p95")) is not None]
        page.add(svg.render(svg.Chart(key=f"trend-{metric}", title=f"{title} (ms)", lines=lines,
                                      x_label="run", y_label="ms", x_max=float(len(trend)),
                                      x_ticks=ticks, marks=marks, height=160)))
    page.add("<table><tr><th>run</th><th>started</th><th>exit</th></tr>",
             *(f"<tr><td>{tp.run_id}</td><td>{_t(when(tp.started_at))}</td>"
               f"<td>{tp.exit_code}</td></tr>" for tp in trend[-10:]), "</table>")


def _environment(page: _Page) -> None:
    r = page.r
    # The environment names the version too (as "streamquake"): one row, first.
    rows = [("streamquake", r.tool_version),
            *sorted((k, v) for k, v in r.environment.items() if k != "streamquake"),
            ("scenario file", r.scenario_file), ("target", target_text(r)),
            ("started", when(r.started_at)), ("finished", when(r.finished_at))]
    page.add("<h2>Environment</h2><table>",
             *(f"<tr><td>{_t(k)}</td><td class=\"l\">{_t(v)}</td></tr>" for k, v in rows),
             "</table><details><summary>Scenario as run (header values redacted)</summary><pre>",
             _t(json.dumps(r.scenario_echo, indent=1)), "</pre></details>")
