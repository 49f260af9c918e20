"""Inline SVG line charts, written as text: no JavaScript, no library, nothing to fetch.

A chart is a few polylines, shaded bands (fault windows), phase edges, axes and a legend; a
70-second run's nine charts come to a few tens of kilobytes and render in any browser offline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

PALETTE = {
    "p50": "#1f77b4", "p95": "#ff7f0e", "baseline": "#2ca02c", "fault": "#d62728",
    "recovery": "#1f77b4", "warmup": "#7f7f7f", "sent": "#1f77b4", "errors": "#d62728",
    "in_flight": "#9467bd",
}
EXTRA = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
# Each fault of a run in its own colour, in the order the run lists them (bands, strip rows).
FAULT_COLORS = ("#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
_LABEL_H = 12     # px between the label lines of fault windows


@dataclass
class Line:
    name: str
    color: str
    points: Sequence[tuple[float, float | None]]
    dash: bool = False


@dataclass
class Band:
    """A shaded x range with a label: a fault window (class ``band``, labelled on the chart),
    or a step's window (class ``sw <kind>``: shaded, named on hover; its edge names it)."""

    x0: float
    x1: float
    label: str
    cls: str = "band"
    color: str | None = None      # a fault's own colour (each fault of a run has one)
    label_row: int = 0            # the label's line at the top: a fault's, so none overprint
    labelled: bool = True         # False: named on hover only (a flapping fault's later windows)


@dataclass
class Mark:
    """A ringed point with a label on hover: a run that regressed."""

    x: float
    y: float
    label: str
    color: str = "#d62728"


@dataclass
class Chart:
    key: str                              # data-chart attribute, for tests and CSS
    title: str
    lines: list[Line]
    x_label: str
    y_label: str
    bands: list[Band] = field(default_factory=list)
    edges: list[tuple[float, str]] = field(default_factory=list)   # (x, phase name)
    x_max: float | None = None
    y_max: float | None = None
    x_ticks: list[tuple[float, str]] | None = None   # (x, label); default: evenly spaced
    marks: list[Mark] = field(default_factory=list)
    width: int = 880
    height: int = 190
    # A log y axis where the values span more than WIDE (a 10 s TTFT under a thin link
    # flattened a 300 ms first-token delay into the axis on a linear one). Not for counts.
    log_when_wide: bool = False


WIDE = 30.0          # max / smallest positive value beyond which a log axis is used


_L, _R, _T, _B = 56, 14, 26, 30
_LEGEND_H = 13     # px between the legend's lines


def nice(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above ``value``."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    exp = math.floor(math.log10(value))
    scale = 10.0 ** exp
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * scale >= value * 0.9999:
            return m * scale
    return 10.0 * scale


def _ticks(top: float, n: int = 4) -> list[float]:
    step = nice(top / n)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def _num(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.3g}"


def log_range(chart: Chart) -> tuple[float, float] | None:
    """The decades a log y axis spans (10^a, 10^b), or None where a linear one does."""
    ys = [y for line in chart.lines for _, y in line.points if y is not None and y > 0]
    if not chart.log_when_wide or chart.y_max is not None or not ys or \
            max(ys) / min(ys) <= WIDE:
        return None
    return 10.0 ** math.floor(math.log10(min(ys))), 10.0 ** math.ceil(math.log10(max(ys)))


def render(chart: Chart) -> str:
    xs = [x for line in chart.lines for x, y in line.points if y is not None]
    ys = [y for line in chart.lines for _, y in line.points if y is not None]
    x_top = chart.x_max if chart.x_max is not None else nice(max(xs, default=1.0))
    y_top = chart.y_max if chart.y_max is not None else nice(max(ys, default=1.0) * 1.05)
    x_top, y_top = max(x_top, 1e-9), max(y_top, 1e-9)
    rows = _legend_rows(chart)
    extra = _LEGEND_H * (len(rows) - 1)       # a legend too long for one line pushes the plot down
    top, height = _T + extra, chart.height + extra
    w, h = chart.width - _L - _R, chart.height - _T - _B
    logs = log_range(chart)

    def sx(x: float) -> float:
        return _L + min(max(x, 0.0), x_top) / x_top * w

    def sy(y: float) -> float:
        if logs is not None:
            lo, hi = math.log10(logs[0]), math.log10(logs[1])
            return top + h - (min(max(math.log10(max(y, logs[0])), lo), hi) - lo) / (hi - lo) * h
        return top + h - min(max(y, 0.0), y_top) / y_top * h

    y_ticks = _ticks(y_top) if logs is None else [
        10.0 ** e for e in range(round(math.log10(logs[0])), round(math.log10(logs[1])) + 1)]
    y_label = chart.y_label + (" (log scale)" if logs is not None else "")

    out = [f'<svg class="chart" data-chart="{escape(chart.key)}" role="img" '
           f'aria-label="{escape(chart.title)}" viewBox="0 0 {chart.width} {height}" '
           f'width="{chart.width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text class="t" x="{_L}" y="15">{escape(chart.title)}</text>']
    for band in chart.bands:
        x0, x1 = sx(band.x0), sx(band.x1)
        fill = f' style="fill:{band.color}"' if band.color else ""
        out.append(f'<rect class="{band.cls}"{fill} x="{x0:.1f}" y="{top}" '
                   f'width="{max(1.0, x1 - x0):.1f}" height="{h}">'
                   f'<title>{escape(band.label)}</title></rect>'
                   + (f'<text class="bl"{fill} x="{x0 + 3:.1f}" '
                      f'y="{top + 11 + _LABEL_H * band.label_row}">{escape(band.label)}</text>'
                      if band.cls == "band" and band.labelled else ""))
    for y in y_ticks:
        out.append(f'<line class="g" x1="{_L}" x2="{_L + w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}"/>'
                   f'<text class="yl" x="{_L - 4}" y="{sy(y) + 3:.1f}">{_num(y)}</text>')
    ticks = chart.x_ticks if chart.x_ticks is not None else [(x, _num(x))
                                                             for x in _ticks(x_top, 8)]
    for x, text in ticks:
        out.append(f'<text class="xl" x="{sx(x):.1f}" y="{top + h + 13}">{escape(text)}</text>')
    for x, name in chart.edges:
        out.append(f'<line class="e" x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + h}"/>'
                   f'<text class="el" x="{sx(x) + 3:.1f}" y="{top + h - 4}">{escape(name)}</text>')
    out.append(f'<line class="a" x1="{_L}" x2="{_L + w}" y1="{top + h}" y2="{top + h}"/>'
               f'<line class="a" x1="{_L}" x2="{_L}" y1="{top}" y2="{top + h}"/>'
               f'<text class="xl" x="{_L + w / 2:.0f}" y="{height - 3}">'
               f'{escape(chart.x_label)}</text>'
               f'<text x="4" y="{top + h + 26}">y: {escape(y_label)}</text>')
    for line in chart.lines:
        out += _polyline(line, sx, sy)
    for m in chart.marks:
        out.append(f'<circle class="mark" cx="{sx(m.x):.1f}" cy="{sy(m.y):.1f}" r="6" '
                   f'fill="none" stroke="{m.color}" stroke-width="2">'
                   f'<title>{escape(m.label)}</title></circle>')
    out.append(_legend(rows))
    out.append("</svg>")
    return "".join(out)


def _polyline(line: Line, sx: Callable[[float], float],
              sy: Callable[[float], float]) -> list[str]:
    segments: list[list[str]] = [[]]
    for x, y in line.points:
        if y is None:
            if segments[-1]:
                segments.append([])
            continue
        segments[-1].append(f"{sx(x):.1f},{sy(y):.1f}")
    dash = ' stroke-dasharray="5 3"' if line.dash else ""
    out = []
    for seg in segments:
        if len(seg) == 1:
            cx, cy = seg[0].split(",")
            out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{line.color}"/>')
        elif seg:
            out.append(f'<polyline fill="none" stroke="{line.color}" stroke-width="1.6"{dash} '
                       f'points="{" ".join(seg)}"><title>{escape(line.name)}</title></polyline>')
    return out


def _legend_rows(chart: Chart) -> list[list[tuple[Line, float]]]:
    """The legend's entries (each with its x), right-aligned, in as many lines as it takes to
    keep clear of the title (11 steps' CDFs overprinted it on one line)."""
    clear = _L + 6.6 * len(chart.title) + 16      # where the title ends, and a margin
    rows: list[list[tuple[Line, float]]] = [[]]
    x = float(chart.width - _R)
    for line in reversed(chart.lines):
        width = 6.2 * len(line.name) + 26
        if x - width < clear and rows[-1]:
            rows.append([])
            x = float(chart.width - _R)
        x -= width
        rows[-1].append((line, x))
    return rows


def _legend(rows: list[list[tuple[Line, float]]]) -> str:
    parts = []
    for i, row in enumerate(rows):
        y = 11 + _LEGEND_H * i
        for line, x in row:
            dash = ' stroke-dasharray="5 3"' if line.dash else ""
            parts.append(f'<line x1="{x:.0f}" x2="{x + 16:.0f}" y1="{y}" y2="{y}" '
                         f'stroke="{line.color}" stroke-width="2"{dash}/><text class="lg" '
                         f'x="{x + 20:.0f}" y="{y + 4}">{escape(line.name)}</text>')
    return "".join(parts)


@dataclass
class Segment:
    """One stretch of a strip row: a step, a step's load, a fault's window."""

    x0: float
    x1: float
    text: str                             # drawn where it fits; always on hover
    cls: str
    title: str = ""
    color: str | None = None              # a fault's own colour, as on the charts


@dataclass
class Strip:
    """The whole timeline at a glance: one row per thing (steps, load, each fault), its
    stretches drawn on the run's time axis."""

    key: str
    title: str
    rows: list[tuple[str, list[Segment]]]
    x_max: float
    x_label: str
    width: int = 880
    row_h: int = 22


def render_strip(strip: Strip) -> str:
    left = max(_L, 8 + max((round(6.2 * len(name)) for name, _ in strip.rows), default=0))
    w = strip.width - left - _R
    height = _T + len(strip.rows) * strip.row_h + _B
    top = max(strip.x_max, 1e-9)

    def sx(x: float) -> float:
        return left + min(max(x, 0.0), top) / top * w

    out = [f'<svg class="chart strip" data-chart="{escape(strip.key)}" role="img" '
           f'aria-label="{escape(strip.title)}" viewBox="0 0 {strip.width} {height}" '
           f'width="{strip.width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text class="t" x="{left}" y="15">{escape(strip.title)}</text>']
    for x in _ticks(top, 8):
        out.append(f'<line class="g" x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{_T}" '
                   f'y2="{height - _B}"/><text class="xl" x="{sx(x):.1f}" '
                   f'y="{height - _B + 13}">{_num(x)}</text>')
    for i, (name, segments) in enumerate(strip.rows):
        y = _T + i * strip.row_h
        out.append(f'<text class="yl" x="{left - 4}" y="{y + strip.row_h / 2 + 4:.1f}">'
                   f'{escape(name)}</text>')
        for seg in segments:
            x0, x1 = sx(seg.x0), sx(seg.x1)
            width = max(1.0, x1 - x0)
            fill = f' style="fill:{seg.color}"' if seg.color else ""
            out.append(f'<rect class="{escape(seg.cls)}"{fill} x="{x0:.1f}" y="{y + 2}" '
                       f'width="{width:.1f}" height="{strip.row_h - 4}">'
                       f'<title>{escape(seg.title or seg.text)}</title></rect>')
            if 6.2 * len(seg.text) + 6 <= width:
                out.append(f'<text class="sl" x="{x0 + 3:.1f}" y="{y + strip.row_h / 2 + 4:.1f}">'
                           f'{escape(seg.text)}</text>')
    out.append(f'<text class="xl" x="{left + w / 2:.0f}" y="{height - 3}">'
               f'{escape(strip.x_label)}</text></svg>')
    return "".join(out)
