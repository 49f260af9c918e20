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
