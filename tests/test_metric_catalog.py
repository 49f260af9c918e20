"""One metric catalog (streamquake/metric_catalog.py), and every place that names metrics agrees
with it: the schema accepts exactly its gating metrics, the stats measure each, the summary
table and the sentences word each as it says, and compare, history, the live view and its
abort conditions, the per-second series, the CDFs, report.html's charts, Prometheus and the
saturation rule cover exactly the metrics it gives them. Where a place derives its list from
the catalog, the check reads what the place does (a real sample through it), so a catalog
entry that no code measures or shows fails here too. And no module keeps a literal copy of
one of the catalog's lists on the side."""

from __future__ import annotations

import ast
import tempfile
import typing
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from streamquake import metric_catalog as catalog
from streamquake.loadgen import attribution, scorecard
from streamquake.loadgen import metrics as loadgen_metrics
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample
from streamquake.metric_catalog import CATALOG, METRICS, names
from streamquake.reports import between_runs, compare, history, html, phrasing, prometheus, table
from streamquake.reports.saved_run import shares
from streamquake.result import PhaseResult, RunResult
from streamquake.run import saturation, series, watch
from streamquake.run.timeline import PhaseWindow
from streamquake.scenario import schema

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamquake"
ALL = frozenset(METRICS)


def _full(**kw: object) -> RequestSample:
    """A request that measured everything a request can: open loop, a new TLS connection,
    reasoning before its answer, usage, SSE ids, the server's prefix cache."""
    fields: dict[str, object] = {
        "cls": "chat", "sent": 1000.0, "scheduled": 999.98, "send_ms": 6.0, "dns_ms": 1.0,
        "connect_ms": 1.5, "tls_ms": 2.0, "write_ms": 0.5, "ttfb_ms": 50.0, "ttft_ms": 80.0,
        "ttfa_ms": 95.0, "e2e_ms": 400.0, "itl_ms": [10.0, 12.0, 11.0, 30.0],
        "content_events": 5, "reasoning_events": 1, "content_reads": 5, "output_tokens": 5,
        "usage_tokens": 6, "expected_events": 5, "missing_events": 1, "stalls": 1,
        "status": 200, "cache_n": 90, "prompt_n": 10}
    fields.update(kw)
    return RequestSample(**fields)  # type: ignore[arg-type]


def _samples() -> list[RequestSample]:
    return [_full(), _full(sent=1000.5, scheduled=1000.45, stalls=0),
            _full(sent=1001.0, scheduled=1000.9, e2e_ms=30.0, itl_ms=[], error="connect")]


def _stats() -> Stats:
    st = Stats.from_samples(_samples())
    st.add_not_sent()
    return st


# -- the catalog itself ------------------------------------------------------------------------

def test_the_catalog_is_one_coherent_entry_per_metric() -> None:
    assert len(CATALOG) == len(METRICS), "a name twice in the catalog"
    for m in CATALOG:
        # The style's rule: a metric's unit is in its name; a rate is a fraction.
        assert (m.kind == "rate") == (m.unit == "fraction"), m.name
        assert m.name.endswith({"ms": "_ms", "s": "_s", "tokens/s": "_per_s"}.get(m.unit, "")), m
        assert m.title and m.about, m.name
        if m.kind == "rate":
            assert all(stat is None for _, stat in m.rows), m.name
            assert set(m.compared) | set(m.stored) | set(m.watched) <= {"value"}, m.name
            assert not (m.censorable or m.series or m.cdf or m.live or m.prometheus), m.name
        else:
            assert "value" not in (*m.compared, *m.stored, *m.watched), m.name
        assert set(m.watched) <= set(m.stored), f"{m.name}: history watches what it stores"
        if m.kind == "per_fault":
            assert not (m.aborts or m.rows or m.compared or m.stored or m.series), m.name
    assert catalog.RECOVERY_TIME in names("per_fault")
    assert len({label for m in CATALOG for label, _ in m.rows}) == \
        sum(len(m.rows) for m in CATALOG), "a summary row label twice"


# -- the schema --------------------------------------------------------------------------------

def _field_names(model: type, field: str) -> tuple[str, ...]:
    annotation = model.model_fields[field].annotation  # type: ignore[attr-defined]
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return typing.get_args(annotation)


def _slo(metric: str) -> dict[str, object]:
    kind = METRICS[metric].kind if metric in METRICS else "histogram"
    if kind == "rate":
        return {"metric": metric, "max": "1%"}
    if kind == "per_fault":
        return {"metric": metric, "max": "5s"}
    return {"metric": metric, "percentile": 95, "max": 100}


def test_the_schema_accepts_exactly_the_catalogs_gating_metrics() -> None:
    assert _field_names(schema.SLOSpec, "metric") == names(gates=True)
    assert _field_names(schema.AbortCondition, "metric") == names(aborts=True)
    assert _field_names(schema.RecoverySpec, "metrics") == names("histogram", gates=True)
    for m in names(gates=True):
        schema.SLOSpec.model_validate(_slo(m))
    for m in ALL - set(names(gates=True)):
        with pytest.raises(ValidationError):
            schema.SLOSpec.model_validate(_slo(m))
    with pytest.raises(ValidationError, match="Input should be 'ttfb_ms'"):
        schema.SLOSpec.model_validate(_slo("no_such_metric_ms"))     # not in the catalog
    for m in names(aborts=True):
        schema.AbortCondition.model_validate(
            {"metric": m, "above": 0.5, **({"percentile": 95} if m in names("histogram")
                                            else {})})
    for m in ALL - set(names(aborts=True)):
        with pytest.raises(ValidationError):
            schema.AbortCondition.model_validate({"metric": m, "percentile": 95, "above": 1})
    assert names("histogram") == schema.HISTOGRAM_METRICS
    assert names("rate") == schema.RATE_METRICS
    assert frozenset(names(higher_is_better=True)) == schema.HIGHER_IS_BETTER
    assert schema.RECOVERY_TIME == catalog.RECOVERY_TIME


# -- the stats (loadgen/metrics.py) -------------------------------------------------------------

def test_the_stats_measure_every_metric_of_the_catalog_and_no_other() -> None:
    st = _stats()
    for m in names("histogram"):
        assert st.count(m) > 0, f"{m}: in the catalog, measured by no Stats.add_*"
    for m in names("rate"):
        assert st.value(m) is not None, m
    with pytest.raises(KeyError):
        st.value("first_event_rate")
    out = st.to_dict()
    assert {k for k, v in out.items() if isinstance(v, dict) and "p95" in v} == \
        set(names("histogram")), "the stats' histograms are the catalog's"
    assert set(names("rate")) <= out.keys()
    assert set(loadgen_metrics._TRIALS) == set(names("rate")), "each rate's trials"
    for m in names("histogram"):
        if m in names(censorable=True):
            st.add_censored(m, 1.0)
        else:
            with pytest.raises(KeyError):
                st.add_censored(m, 1.0)


def test_every_percentile_the_reports_read_is_in_the_stats() -> None:
    out = _stats().to_dict()
    for m in CATALOG:
        wanted = {s for _, s in m.rows if s is not None} | set(m.stored) | set(m.watched)
        for stat in wanted - {"value"}:
            summary = out[m.name]
            assert isinstance(summary, dict) and summary.get(stat) is not None, (m.name, stat)


# -- the reports' words ------------------------------------------------------------------------

@pytest.mark.parametrize("metric", sorted(ALL))
def test_each_metric_is_worded_in_its_unit(metric: str) -> None:
    m = METRICS[metric]
    if m.kind == "rate":
        assert phrasing.value_text(metric, 0.25) == "25.0%"
        assert table.fmt_value(metric, 0.25) == "25.0%"
    else:
        assert phrasing.value_text(metric, 12.34) == f"12.3 {m.unit}"
        assert table.fmt_value(metric, 12.34) == "12.3"
    assert phrasing.unit(metric) == ("" if m.kind == "rate" else f" {m.unit}")


def _result(stats: Stats) -> RunResult:
    d = stats.to_dict()
    return RunResult("s", "s.yaml", {"load": {"retries": "standard"}}, "0", 0.0, 1.0, None,
                     [PhaseResult(p, 0.0, 1.0, dict(d)) for p in table.PHASE_COLUMNS],
                     [], [], {})


def test_the_summary_table_shows_each_metric_as_the_catalog_words_it() -> None:
    by_metric: dict[str, list[tuple[str, str | None]]] = {}
    for label, key, stat in table.SUMMARY_METRICS:
        if key in ALL:
            by_metric.setdefault(key, []).append((label, stat))
        else:   # the table's own rows (counts, shares, the client) are named as no metric is
            assert not key.endswith(("_ms", "_rate", "_per_s")), f"{key}: not in the catalog"
    assert by_metric == {m.name: list(m.rows) for m in CATALOG if m.rows}
    shown = dict(table.summary_rows(_result(_stats())))
    for m in CATALOG:
        for label, _ in m.rows:
            assert label in shown, f"{m.name}: its row '{label}' is not shown"
            assert all(text != "-" for text in shown[label].values()), (label, shown[label])


# -- compare and history ----------------------------------------------------------------------

def test_compare_judges_what_the_catalog_says_and_can_compute_each() -> None:
    judged = tuple((m.name, catalog.stat_percentile(s)) for m in CATALOG for s in m.compared)
    assert judged == compare.METRICS
    phase = shares(_samples(), [PhaseWindow("baseline", 999.0, 1010.0)])["baseline"]
    prep = compare._prepare(phase)
    ones = [1] * prep.n
    for metric, pct in compare.METRICS:
        assert compare._metric(prep, ones, metric, pct) is not None, (metric, pct)
    assert frozenset(names(higher_is_better=True)) == compare.HIGHER_IS_BETTER
    # between_runs.py judges compare's and history's figures by its own lists: they agree on
    # every metric judged between runs.
    assert frozenset(names(higher_is_better=True)) == between_runs.HIGHER_IS_BETTER
    judged_between = [m for m in CATALOG if m.compared or m.watched]
    assert {m.name for m in judged_between if m.kind == "rate"} <= between_runs.RATES
    assert set(names("rate")) >= between_runs.RATES
    for m in judged_between:
        assert between_runs.is_timing(m.name) == m.timing, m.name


def test_history_stores_and_watches_what_the_catalog_says() -> None:
    stored = (*((m.name, s) for m in CATALOG for s in m.stored), ("requests", "value"))
    assert stored == history.STORED
    assert tuple((m.name, s) for m in CATALOG for s in m.watched) == history.WATCHED
    rows = history._rows(_result(_stats()))
    got = {(metric, stat) for phase, metric, stat, value, _ in rows
           if phase == "baseline" and value is not None}
    assert set(history.STORED) <= got


# -- the run: saturation, the live view and abort conditions, series and CDFs ------------------

def test_the_saturation_rule_leaves_unjudged_exactly_the_catalogs_timings() -> None:
    assert frozenset(names(timing=True)) == saturation.TIMING_METRICS


def test_the_live_view_and_abort_conditions_read_every_metric_they_may_name() -> None:
    assert names(live=True) == watch.LATENCIES
    window = _samples()
    for m in names(aborts=True):
        if m in names("histogram"):
            assert watch._values(window, m), f"{m}: abort conditions may name it, no value"
        else:
            value, n = watch._rate(window, m)
            assert value is not None and n, m
    for m in set(names("rate")) - set(names(aborts=True)):
        with pytest.raises(KeyError):
            watch._rate(window, m)


def test_the_series_and_cdfs_cover_the_catalogs_metrics() -> None:
    assert names(series=True) == scorecard.SERIES_METRICS
    assert {m for m, _ in scorecard.series_values(_full())} == set(names(series=True))
    assert names(cdf=True) == series.CDF_METRICS
    cdfs = series.cdfs({"baseline": _stats()})
    assert [c.metric for c in cdfs] == list(names(cdf=True))
    assert all(c.points for c in cdfs)
    # report.html draws them, titled as the catalog titles them.
    assert [(m, title) for m, title, _ in html.TIMELINE] == \
        [(m, METRICS[m].title) for m in names(series=True)]
    assert [unit for _, _, unit in html.TIMELINE] == [METRICS[m].unit for m in names(series=True)]
    assert {m: METRICS[m].title for m in names(cdf=True)} == html.CDF_TITLES


# -- Prometheus --------------------------------------------------------------------------------

def test_prometheus_exports_a_histogram_for_each_metric_the_catalog_exports() -> None:
    exported = {m.name: f"streamquake_{m.prometheus}_seconds" for m in CATALOG if m.prometheus}
    with tempfile.TemporaryDirectory() as tmp:
        srv = prometheus.MetricsServer(scenario="s", samples_dir=Path(tmp), port=None)
        windows = [attribution.Window("baseline", 999.0, 1010.0)]
        for s in _samples():
            attribution.attribute(s, windows, lambda name, s=s: srv._series(name, s.cls))
        text = generate_latest(srv.registry).decode()
    seconds = {line.split()[2] for line in text.splitlines()
               if line.startswith("# TYPE") and line.split()[3] == "histogram"}
    assert seconds == set(exported.values())
    for name, family in exported.items():
        assert f"# HELP {family} {METRICS[name].about}" in text
        count = next(line for line in text.splitlines()
                     if line.startswith(f"{family}_count{{") and 'phase="baseline"' in line)
        assert float(count.rsplit(" ", 1)[1]) > 0, f"{name}: exported, never observed"
        assert f"``{family}``" in (prometheus.__doc__ or ""), f"{family}: not in the docstring"


# -- no list on the side -----------------------------------------------------------------------

# Literal collections that hold exactly one of the catalog's lists, by the name they are held
# under, each with why it may: what a metric is measured from (the catalog's entry does not say
# how), or the summary's layout (where each metric's rows go).
ALLOWED_COPIES = {
    ("loadgen/metrics.py", "_TRIALS"): "each rate's counts: how it is measured",
    ("reports/table.py", "_LAYOUT"): "where the summary shows each metric's rows",
}


def _catalog_lists() -> dict[frozenset[str], str]:
    lists: dict[frozenset[str], str] = {ALL: "every metric"}
    flags = ("higher_is_better", "censorable", "gates", "aborts", "timing", "series", "cdf",
             "live", "rows", "compared", "stored", "watched", "prometheus")
    for kind in (None, "histogram", "rate"):
        if kind is not None:
            lists[frozenset(names(kind))] = f"kind {kind}"
        for flag in flags:
            got = frozenset(m.name for m in CATALOG if getattr(m, flag)
                            and (kind is None or m.kind == kind))
            lists.setdefault(got, f"{kind or 'every'} metric with {flag}")
    return {k: v for k, v in lists.items() if len(k) >= 2}


def _literal_names(node: ast.AST) -> frozenset[str]:
    """The metric names a tuple, list, set or dict literal holds (as items or as the first
    item of each of its tuples)."""
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    out = set()
    for item in items:
        if isinstance(item, ast.Tuple) and item.elts:
            item = item.elts[0]
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            out.add(item.value)
    return frozenset(out) & ALL


def _symbol(stmt: ast.stmt) -> str:
    """The name a module-level statement defines (its first, for a tuple of targets)."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return stmt.name
    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
        [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return next((t.id for t in targets if isinstance(t, ast.Name)), f"line {stmt.lineno}")


def _copies(package: Path) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]]]:
    """(copies of a catalog list by (module, the name holding it), every (module, name))."""
    lists, found, symbols = _catalog_lists(), {}, set()
    for path in sorted(package.rglob("*.py")):
        if path.name == "metric_catalog.py":
            continue
        where = path.relative_to(package).as_posix()
        for stmt in ast.parse(path.read_text()).body:
            symbols.add((where, _symbol(stmt)))
            for node in ast.walk(stmt):
                if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict) and \
                        (held := _literal_names(node)) in lists:
                    found[(where, _symbol(stmt))] = f"{where}:{node.lineno}: {lists[held]}"
    return found, symbols


def test_no_module_keeps_its_own_copy_of_a_catalog_list() -> None:
    found, symbols = _copies(PACKAGE)
    extra = [v for k, v in found.items() if k not in ALLOWED_COPIES]
    assert not extra, "derive these from streamquake/metric_catalog.py: " + "; ".join(extra)
    assert set(ALLOWED_COPIES) <= symbols, "an allowance for a name that is gone"
