"""``streamquake run``: a scenario's run, its flags and its dry run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from streamquake.cli.base import (
    EXIT_CODES_HELP,
    app,
    check_out_dir,
    console,
    duration_option,
    err_console,
    port_option,
    print_problems,
    read_scenario,
)
from streamquake.errors import ScenarioError


@app.command(epilog=EXIT_CODES_HELP)
def run(
    scenario_file: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for report.json, junit.xml, summary.md, "
                           "report.html, timeline.csv, samples.csv (written on every exit).")
    ] = Path("out"),
    history: Annotated[
        Path | None, typer.Option("--history", help="Append this run to a SQLite history "
                                  "store (created if missing); report.html shows the trend.")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics on this port "
                                 "while the run lasts (0: any free port; the URL is printed).")
    ] = None,
    metrics_host: Annotated[
        str, typer.Option("--metrics-host", help="Address for --metrics-port.")
    ] = "127.0.0.1",
    metrics_file: Annotated[
        Path | None, typer.Option("--metrics-file", help="Write the final Prometheus figures "
                                  "to this .prom file when the run ends (node_exporter's "
                                  "textfile format, replaced atomically).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what the run would change, where, and how "
                           "it would be undone; start and change nothing.")
    ] = False,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override one scenario field, e.g. "
                                       "--set load.users=50 or --set faults.0.delay=80ms "
                                       "(repeatable; YAML values).")
    ] = None,
    workers: Annotated[
        str | None, typer.Option("--workers", help="Locust worker processes on this host "
                                 "(N, or auto: one per core); sets load.workers.")
    ] = None,
    remote_workers: Annotated[
        int | None, typer.Option("--remote-workers", help="Also wait for this many workers "
                                 "from other hosts (`streamquake worker --master`).")
    ] = None,
    master_bind: Annotated[
        str | None, typer.Option("--master-bind", help="Where remote workers connect "
                                 "(HOST:PORT; default 127.0.0.1:5557).")
    ] = None,
    lease: Annotated[
        str, typer.Option("--lease", help="The watchdog's lease: if this process stops renewing "
                          "it for this long (killed, stopped), the local agent undoes its "
                          "faults.")
    ] = "10s",
    no_watchdog: Annotated[
        bool, typer.Option("--no-watchdog", help="Hold faults without the local agent's lease "
                           "(a killed run then leaves them to `streamquake recover`).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the verdicts as one JSON document on stdout "
                           "(everything for people goes to stderr).")
    ] = False,
    otlp: Annotated[
        str | None, typer.Option("--otlp", help="After the run, send a span per request and "
                                 "the GenAI client metrics per step to this OpenTelemetry "
                                 "OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318 (/v1/traces "
                                 "and /v1/metrics are added); a failed export is a warning.")
    ] = None,
) -> None:
    """Run a scenario: baseline, fault, recovery; print verdicts; write reports."""
    # Bad flags and an unreadable file are usage errors: one sentence, exit 2, nothing written.
    lease_s = None if no_watchdog else duration_option("--lease", lease)
    flags = _load_flags(workers, remote_workers, master_bind)
    if metrics_port is not None:
        port_option("--metrics-port", metrics_port)
    if metrics_file is not None:
        _metrics_file_option(metrics_file)
    if otlp is not None:
        from streamquake.reports.otlp import otlp_endpoint

        otlp = otlp_endpoint(otlp)
    text = read_scenario(scenario_file)
    overrides = [*(overrides or []), *flags]
    if dry_run:
        _dry_run(scenario_file, text, overrides)
        return
    check_out_dir(out)

    from streamquake.sessions.run import RunRequest, run_and_report

    request = RunRequest(scenario_file=scenario_file, text=text, overrides=overrides, out=out,
                         lease_s=lease_s, history=history, metrics_port=metrics_port,
                         metrics_host=metrics_host, metrics_file=metrics_file,
                         as_json=as_json, otlp=otlp)
    raise typer.Exit(run_and_report(request, console, err_console, print_problems))


def _load_flags(workers: str | None, remote_workers: int | None,
                master_bind: str | None) -> list[str]:
    """--workers, --remote-workers and --master-bind are --set shorthands."""
    from streamquake.loadgen.worker import parse_master, processes_option

    out = []
    if workers is not None:
        out.append(f"load.workers={processes_option(workers, '--workers')}")
    if remote_workers is not None:
        if remote_workers < 0:
            raise ScenarioError(f"--remote-workers {remote_workers}: a number of workers, 0 or "
                                "more")
        out.append(f"load.remote_workers={remote_workers}")
    if master_bind is not None:
        host, port = parse_master(master_bind, "--master-bind")
        out.append(f"load.master_bind={f'[{host}]' if ':' in host else host}:{port}")
    return out


def _metrics_file_option(path: Path) -> None:
    if path.suffix != ".prom":
        raise ScenarioError(f"--metrics-file {path}: node_exporter's textfile collector reads "
                            "only files ending in .prom")
    if not path.parent.is_dir() or path.is_dir():
        raise ScenarioError(f"--metrics-file {path}: give a file in an existing directory")


def _dry_run(scenario_file: Path, text: bytes, overrides: list[str]) -> None:
    from streamquake.run.dry_run import dry_run_plan
    from streamquake.scenario import parse_scenario

    lines = dry_run_plan(parse_scenario(text, str(scenario_file), overrides))
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


