"""Thin typer commands over the package; no logic of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from streamquake.errors import StreamquakeError

EXIT_CODES_HELP = """\
Exit codes: 0 all SLOs met; 1 an SLO broken; 2 scenario or usage error;
3 environment/preflight error (target unreachable, missing capability, a fault
could not be applied); 4 a fault could not be reverted (run `streamquake recover`);
130/143 interrupted by Ctrl-C/SIGTERM (faults reverted, partial report written).
"""

app = typer.Typer(
    name="streamquake",
    help="Chaos and load tests for streaming LLM endpoints.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
target_app = typer.Typer(help="The embedded simulated LLM server.", no_args_is_help=True)
app.add_typer(target_app, name="target")

console = Console()
err_console = Console(stderr=True)
_state: dict[str, bool] = {"debug": False}


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


def _fail(exc: StreamquakeError) -> None:
    if _state["debug"]:
        err_console.print_exception()
    problems = getattr(exc, "problems", None) or [str(exc)]
    for line in problems:
        err_console.print(f"Error: {line}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


@app.command(epilog=EXIT_CODES_HELP)
def run(
    scenario_file: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory for report.json, junit.xml, summary.md.")
    ] = Path("out"),
) -> None:
    """Run a scenario: baseline, fault, recovery; print verdicts; write reports."""
    from streamquake.events import Events
    from streamquake.reports.json_report import write_json
    from streamquake.reports.junit import write_junit
    from streamquake.reports.live import attach_live_log
    from streamquake.reports.markdown import write_markdown
    from streamquake.reports.terminal import print_result
    from streamquake.run.runner import Runner
    from streamquake.scenario import load_scenario

    try:
        scenario = load_scenario(scenario_file)
        events = Events()
        attach_live_log(events, console)
        result = Runner(scenario, str(scenario_file), out, events=events).run()
    except StreamquakeError as exc:
        _fail(exc)
        return
    out.mkdir(parents=True, exist_ok=True)
    print_result(result, console)
    for path in (write_json(result, out / "report.json"), write_junit(result, out / "junit.xml"),
                 write_markdown(result, out / "summary.md")):
        console.print(f"wrote {path}", highlight=False)
    raise typer.Exit(result.exit_code)


@app.command(epilog=EXIT_CODES_HELP)
def validate(scenario_file: Annotated[Path, typer.Argument(help="Scenario YAML file.")]) -> None:
    """Check a scenario file and report every problem at once (file:line:col: field: message)."""
    from streamquake.scenario import load_scenario

    try:
        scenario = load_scenario(scenario_file)
    except StreamquakeError as exc:
        _fail(exc)
        return
    faults = ", ".join(f"{f.label} ({f.type}, {f.phase})" for f in scenario.faults) or "none"
    console.print(f"{scenario_file}: OK: scenario '{scenario.name}', "
                  f"{scenario.phases.total_s:g} s, faults: {faults}",
                  highlight=False, soft_wrap=True)


@app.command()
def recover() -> None:
    """Undo every fault the journal lists as applied and not reverted (after a killed run)."""
    from streamquake.run.recovery import recover_all

    try:
        lines, failed = recover_all()
    except StreamquakeError as exc:
        _fail(exc)
        return
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(4)


@target_app.command("serve")
def target_serve(
    protocol: Annotated[
        list[str] | None,
        typer.Option("--protocol", help="Serve only this wire format (repeatable): "
                     "gemini, openai, anthropic, sse."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind (0 = any free port).")] = 8000,
    config: Annotated[
        Path | None,
        typer.Option(help="YAML/JSON file with the target settings (a scenario's "
                     "target.embedded)."),
    ] = None,
) -> None:
    """Run the embedded simulated LLM server in the foreground."""
    import os

    from streamquake.procs import python_module_cmd

    args = ["--host", host, "--port", str(port)]
    for p in protocol or []:
        args += ["--protocol", p]
    if config is not None:
        args += ["--config", str(config)]
    cmd = python_module_cmd("streamquake.target", *args)
    os.execv(cmd[0], cmd)


def main() -> None:
    app()
