"""Each chart's own y scale: a latency whose values span more than svg.WIDE gets a log axis, so
a 300 ms first-token delay stays visible beside a 10 s TTFT under a thin link (issue 34); counts
and narrow ranges stay linear."""

from __future__ import annotations

import re

import pytest

from streamquake.reports import svg


def _ys(text: str) -> list[float]:
    (points,) = re.findall(r'<polyline [^>]*points="([^"]+)"', text)
    return [float(p.split(",")[1]) for p in points.split()]


def _chart(values: list[float], log_when_wide: bool) -> str:
    line = svg.Line("p95", "#000", [(float(i), v) for i, v in enumerate(values)])
    return svg.render(svg.Chart("k", "TTFT (ms)", [line], "s", "ms",
                                log_when_wide=log_when_wide))


@pytest.mark.timeout(10)
def test_a_wide_latency_gets_a_log_axis_where_a_small_step_stays_visible() -> None:
    values = [100.0, 100.0, 400.0, 400.0, 10_000.0, 10_000.0, 100.0]
    linear, log = _chart(values, False), _chart(values, True)
    # The 300 ms step: under 5 px on the linear axis (0 to 10 s), tens of px on the log one.
    lin_y, log_y = _ys(linear), _ys(log)
    assert abs(lin_y[0] - lin_y[2]) < 5
    assert abs(log_y[0] - log_y[2]) > 30
    assert "(log scale)" in log and "(log scale)" not in linear
    assert ">100<" in log and ">1000<" in log and ">10000<" in log     # decade ticks


@pytest.mark.timeout(10)
def test_a_narrow_range_or_a_count_stays_linear() -> None:
    assert "(log scale)" not in _chart([10.0, 12.0, 15.0, 200.0], True)    # within 30x
    assert svg.log_range(svg.Chart("k", "t", [svg.Line("x", "#000", [(0, 0.0), (1, 5000.0)])],
                                   "s", "n", log_when_wide=True)) is None   # zeros only


@pytest.mark.timeout(10)
def test_a_long_legend_wraps_clear_of_the_title_and_the_plot_moves_down() -> None:
    """11 steps' CDFs: on one line their legend ran over the chart's title (issue 34)."""
    title = "TTFT CDF per step"
    lines = [svg.Line(f"step-{i:02d}-name", "#000", [(0.0, 1.0), (1.0, 2.0)])
             for i in range(11)]
    text = svg.render(svg.Chart("k", title, lines, "ms", "share"))
    entries = [(float(x), float(y), name) for x, y, name in
               re.findall(r'<text class="lg" x="([\d.]+)" y="([\d.]+)">([^<]+)</text>', text)]
    assert sorted(name for *_, name in entries) == sorted(line.name for line in lines)
    title_end = 56 + 6.6 * len(title)
    rows: dict[float, list[tuple[float, float]]] = {}
    for x, y, name in entries:
        assert x - 20 > title_end, (x, name)                 # its swatch starts past the title
        rows.setdefault(y, []).append((x - 20, x + 6.2 * len(name)))
    assert len(rows) >= 2, rows
    for spans in rows.values():                               # no two overprint in a line
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    (height,) = re.findall(r'<svg [^>]*height="(\d+)"', text)
    assert int(height) > 190                                  # taller by the legend's lines
    # A short legend stays on one line, the chart its usual height.
    short = svg.render(svg.Chart("k", title, lines[:2], "ms", "share"))
    assert re.findall(r'<svg [^>]*height="(\d+)"', short) == ["190"]
