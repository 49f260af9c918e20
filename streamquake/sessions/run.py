"""One ``streamquake run`` from a readable scenario to its exit code: the runner with the live
view, the Prometheus exposition and history attached, then the verdict on the terminal and every
report written. The CLI parses flags and calls :func:`run_and_report`; nothing here parses flags.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from streamquake.errors import EXIT_ENVIRONMENT, StreamquakeError
from streamquake.loadgen.templates import Redactor, expand_headers, expand_path
from streamquake.result import RunResult
from streamquake.run.events import Events
from streamquake.run.runner import Runner
from streamquake.run.unmeasured import failed_result
from streamquake.scenario import Scenario, parse_scenario


@dataclass(frozen=True)
class RunRequest:
    """What ``run`` was asked, flags already checked."""

    scenario_file: Path
    text: bytes
    overrides: list[str]
    out: Path
    lease_s: float | None
    history: Path | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_file: Path | None = None
    as_json: bool = False
    otlp: str | None = None         # an OTLP/HTTP endpoint, checked (reports/otlp.py)


def run_and_report(req: RunRequest, console: Console, err_console: Console,
                   say_problems: Callable[[StreamquakeError], None]) -> int:
    """Run, print the verdict, write the reports; the process's exit code. With ``as_json``,
    stdout carries one JSON document and everything for people goes to ``err_console``."""
    from streamquake.reports.live import LiveView, attach_live_log
    from streamquake.reports.outputs import write_reports
    from streamquake.reports.prometheus import MetricsServer
    from streamquake.reports.terminal import print_result

    console = err_console if req.as_json else console
    started = time.time()
    scenario: Scenario | None = None
    result: RunResult | None = None
    metrics: MetricsServer | None = None
    metrics_url: str | None = None
    live: LiveView | None = None
    try:
        scenario = parse_scenario(req.text, str(req.scenario_file), req.overrides)
        events = Events()
        attach_live_log(events, console)
        live = LiveView(console, scenario)
        live.attach(events)
        runner = Runner(scenario, str(req.scenario_file), req.out, events=events,
                        lease_s=req.lease_s)
        if req.metrics_port is not None or req.metrics_file is not None:
            metrics = MetricsServer(scenario.name, runner.work_dir / "samples",
                                    req.metrics_port, req.metrics_host)
            metrics.attach(events)
            metrics.start()
            if req.metrics_port is not None:
                metrics_url = metrics.url
                console.print(f"serving Prometheus metrics at {metrics_url}", highlight=False)
        result = runner.run()
    except StreamquakeError as exc:
        say_problems(exc)
        result = failed_result(req.scenario_file, scenario, exc, started)
    finally:
        if live is not None:
            live.stop()
        if metrics is not None:
            metrics.stop()
    if metrics_url is not None:
        result.environment["metrics_url"] = metrics_url
    if req.history is not None:
        _record_history(req.history, result, req.out, console)
    print_result(result, console)     # the verdict first: it must reach the terminal
    written, failed = write_reports(result, req.out)
    if metrics is not None and req.metrics_file is not None:
        try:
            metrics.write(req.metrics_file)
            written.append(req.metrics_file)
        except OSError as exc:
            failed.append((req.metrics_file, exc.strerror or str(exc)))
    for path in written:
        size = f" ({path.stat().st_size / 1024:.0f} KB)" if path.suffix == ".html" else ""
        console.print(f"wrote {path}{size}", highlight=False)
    if req.otlp is not None:
        again = _send_otlp(req.otlp, result, scenario, req.out, console)
        failed += [f for f in again if f[0] not in {path for path, _ in failed}]
    if req.as_json:
        from streamquake.reports.verdicts_json import verdicts_document

        print(json.dumps(verdicts_document(result, req.out), indent=2))
    for path, why in failed:
        err_console.print(f"Error: could not write {path}: {why}; the verdict above stands",
                          markup=False, highlight=False, soft_wrap=True)
    # Lost reports are an environment problem (3), never "an SLO broke" (1) unless one did.
    return result.exit_code if result.exit_code or not failed else EXIT_ENVIRONMENT


def _record_history(path: Path, result: RunResult, out: Path, console: Console) -> None:
    """Append the run and load its scenario's trend; a store that fails is a warning, not a
    reason to lose the run's reports."""
    from streamquake.reports.history import append_run, trend

    try:
        report = (out / "report.json").resolve()
        run_id = append_run(path, result, report)
        result.trend = trend(path, run_id, result, report)
        console.print(f"history: run {run_id} appended to {path}", highlight=False)
    except StreamquakeError as exc:
        result.errors.append(str(exc))


def _send_otlp(url: str, result: RunResult, scenario: Scenario | None, out: Path,
               console: Console) -> list[tuple[Path, str]]:
    """After the reports are written (a receiver that hangs or a Ctrl-C here loses none of
    them): send the run to the OTLP endpoint. A failure is a warning on the terminal and in the
    reports, written again to say it; never a changed verdict or exit code. Returns the reports
    that could not be written again."""
    from rich.markup import escape

    from streamquake.reports.otlp import export_run
    from streamquake.reports.outputs import write_reports

    sent = export_run(result, out / "run" / "samples", url, _redactor(scenario))
    if sent.spans or sent.points:
        console.print(f"sent {sent.spans} spans and {sent.points} metric points to {url}",
                      highlight=False, markup=False)
    elif not sent.problems:
        why = ("the run kept no per-request samples (load.samples: none), which the spans and "
               "metrics are made from" if sent.no_samples else "the run made no requests")
        console.print(f"sent nothing to {url}: {why}", highlight=False, markup=False)
    if not sent.problems:
        return []
    for problem in sent.problems:
        console.print(f"[yellow]warning:[/] {escape(problem)}", soft_wrap=True)
    result.errors += sent.problems
    return write_reports(result, out)[1]


def _redactor(scenario: Scenario | None) -> Callable[[str], str] | None:
    """The load process's own redaction (loadgen/templates.py Redactor), for the failure reasons a
    span carries; None (no reason text sent) where it cannot be built."""
    if scenario is None:
        return None
    import os

    target = scenario.target
    try:
        return Redactor.for_request(target.headers, expand_headers(target.headers, os.environ),
                                    target.path or "",
                                    expand_path(target.path, os.environ) if target.path else "",
                                    os.environ)
    except StreamquakeError:
        return None
