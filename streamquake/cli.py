"""Thin typer commands over the package; no logic of its own."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup, TyperOption

from streamquake.errors import ScenarioError, StreamquakeError
from streamquake.journal import state_dir

if TYPE_CHECKING:
    from typer._click import Context, Parameter


EXIT_CODES_HELP = """\
Exit codes: 0 all SLOs met; 1 an SLO broken; 2 scenario or usage error;
3 environment/preflight error (target unreachable, missing capability,
a fault could not be applied); 4 a fault could not be reverted (run
`streamquake recover`); 5 aborted: an abort condition held or the watchdog
lease lapsed (faults reverted early, the rest measured without them);
6 not judged: nothing broke, but a gating timing check was not judged as
the load generator was saturated in its step (verdicts.saturated: fail
makes that 1, warn 0); 130/143 interrupted by Ctrl-C/SIGTERM (faults
reverted, partial report written).
"""

CAPACITY_EXIT_CODES_HELP = """\
Exit codes: 0 the search ran (the capacity is its result, not a verdict);
2 scenario or usage error; 3 environment/preflight error; 4 a fault could
not be reverted (the search stops; run `streamquake recover`); 130/143
interrupted by Ctrl-C/SIGTERM (the probes so far are reported).
"""

F = TypeVar("F", bound=Callable[..., object])


def _plain_flags(params: list[Parameter]) -> list[Parameter]:
    """Typer labels every option with its type, a flag too (``--json <bool>``), as if it took
    a value: a flag is shown bare."""
    for p in params:
        if isinstance(p, TyperOption) and p.is_flag:
            p.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Context) -> list[Parameter]:
        return _plain_flags(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Context) -> list[Parameter]:
        return _plain_flags(super().get_params(ctx))


class _Typer(typer.Typer):
    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        return super().command(*args, **{"cls": _Command, **kwargs})


app = _Typer(
    name="streamquake",
    help="Chaos and load tests for streaming LLM endpoints.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    cls=_Group,
)
target_app = _Typer(help="The embedded simulated LLM server.", no_args_is_help=True,
                    cls=_Group)
app.add_typer(target_app, name="target")

console = Console()
_console = console
err_console = Console(stderr=True)
_state: dict[str, bool] = {"debug": False}


def _print_version(value: bool) -> None:
    if value:
        from streamquake.version import __version__

        console.print(f"streamquake {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True,
                           help="Print the version and exit.")
    ] = False,
) -> None:
    _state["debug"] = debug


def _print_problems(exc: StreamquakeError) -> None:
    if _state["debug"]:
        err_console.print_exception()
    for line in getattr(exc, "problems", None) or [str(exc)]:
        err_console.print(f"Error: {line}", markup=False, highlight=False, emoji=False,
                          soft_wrap=True)


def _fail(exc: StreamquakeError) -> None:
    _print_problems(exc)
    raise typer.Exit(exc.exit_code)


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
    lease_s = None if no_watchdog else _duration_option("--lease", lease)
    flags = _load_flags(workers, remote_workers, master_bind)
    if metrics_port is not None:
        _port_option("--metrics-port", metrics_port)
    if metrics_file is not None:
        _metrics_file_option(metrics_file)
    if otlp is not None:
        from streamquake.reports.otlp import otlp_endpoint

        otlp = otlp_endpoint(otlp)
    text = _read_scenario(scenario_file)
    overrides = [*(overrides or []), *flags]
    if dry_run:
        _dry_run(scenario_file, text, overrides)
        return
    _check_out_dir(out)

    from streamquake.reports.session import RunRequest, run_and_report

    request = RunRequest(scenario_file=scenario_file, text=text, overrides=overrides, out=out,
                         lease_s=lease_s, history=history, metrics_port=metrics_port,
                         metrics_host=metrics_host, metrics_file=metrics_file,
                         as_json=as_json, otlp=otlp)
    raise typer.Exit(run_and_report(request, _console, err_console, _print_problems))


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


def _port_option(name: str, port: int) -> int:
    if not 0 <= port <= 65535:
        raise ScenarioError(f"{name} {port}: a port is 1 to 65535 (0: any free port)")
    return port


def _metrics_file_option(path: Path) -> None:
    if path.suffix != ".prom":
        raise ScenarioError(f"--metrics-file {path}: node_exporter's textfile collector reads "
                            "only files ending in .prom")
    if not path.parent.is_dir() or path.is_dir():
        raise ScenarioError(f"--metrics-file {path}: give a file in an existing directory")


def _read_scenario(path: Path) -> bytes:
    from streamquake.located_yaml import read_file

    return read_file(path, "scenario file")


def _duration_option(name: str, text: str) -> float:
    from streamquake.units import parse_duration_s

    try:
        value = parse_duration_s(text)
    except ValueError as exc:
        raise ScenarioError(f"{name} {text}: {exc}") from None
    if value <= 0:
        raise ScenarioError(f"{name} {text}: must be longer than 0 s, e.g. {name} 10s")
    return value


def _dry_run(scenario_file: Path, text: bytes, overrides: list[str]) -> None:
    from streamquake.run.dry_run import dry_run_plan
    from streamquake.scenario import parse_scenario

    lines = dry_run_plan(parse_scenario(text, str(scenario_file), overrides))
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _check_out_dir(out: Path) -> None:
    """Refuse an --out that cannot take the reports before anything runs: finding out after a
    ten-minute run would lose it."""
    from streamquake.errors import EXIT_ENVIRONMENT, EXIT_SCENARIO

    def refuse(message: str, code: int) -> None:
        err_console.print(f"Error: {message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(code)

    if out.exists() and not out.is_dir():
        refuse(f"--out {out} is a file, not a directory: give a directory (it is created "
               "if missing)", EXIT_SCENARIO)
    probe = out / ".streamquake-write-test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x" * 4096)
    except OSError as exc:
        refuse(f"cannot write the reports to --out {out}: {exc.strerror or exc} (a read-only "
               "or full file system?); give another directory", EXIT_ENVIRONMENT)
    finally:
        with contextlib.suppress(OSError):      # a path under a file: nothing to remove
            probe.unlink(missing_ok=True)


# ``compare A1 A2 -- B1 B2``: click takes ``--`` for the end of the options and drops it, so the
# sides would be lost; it is swapped for this marker first. A NUL cannot be in an argument, so
# no path is ever taken for it.
_B_SIDE = "\0--"


class _SidesCommand(_Command):
    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, [_B_SIDE if arg == "--" else arg for arg in args])


def _sides(runs: list[str]) -> tuple[list[Path], list[Path]]:
    """The runs of A and of B: ``A B``, or ``A1 A2 -- B1 B2``."""
    marks = runs.count(_B_SIDE)
    a: list[Path] = []
    b: list[Path] = []
    if marks == 1:
        at = runs.index(_B_SIDE)
        a, b = [Path(r) for r in runs[:at]], [Path(r) for r in runs[at + 1:]]
    elif marks == 0 and len(runs) == 2:
        a, b = [Path(runs[0])], [Path(runs[1])]
    if not a or not b:
        raise ScenarioError(f"compare got {len(runs) - marks} run(s)"
                            f"{f' and {marks} --' if marks else ''}; give run A and run B "
                            "(compare A B), or the runs of A, then --, then the runs of B "
                            "(compare A1 A2 A3 -- B1 B2)")
    return a, b


@app.command(cls=_SidesCommand,
             epilog="Exit codes: 0 no regression, or not judged (too few runs of A to know the "
             "variation between runs; said); 1 a metric is worse beyond the margin; 2 usage "
             "error (a report that cannot be read, or runs of different scenarios without "
             "--different-scenarios).")
def compare(
    runs: Annotated[list[str], typer.Argument(
        help="A B: run A (the reference) and run B (the candidate), each an --out directory or "
        "its report.json; or several runs a side: A1 A2 A3 -- B1 B2.", show_default=False,
        metavar="A... [--] B...")],
    tolerance: Annotated[
        str, typer.Option(help="Changes within this share of A are 'same' (e.g. 10%).")
    ] = "10%",
    min_runs: Annotated[
        int, typer.Option(help="Judge only with at least this many runs of A (the variation "
                          "between runs needs several); 1 judges one run a side by the "
                          "requests within the two runs.")
    ] = 3,
    confidence: Annotated[float, typer.Option(help="Confidence of the intervals (one run a "
                                              "side).")] = 0.95,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples (one run a side).")] = 1000,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", help="Also write the comparison as Markdown "
                                  "(for a merge-request comment).")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the comparison as JSON.")
    ] = None,
    different_scenarios: Annotated[
        bool, typer.Option("--different-scenarios", help="Compare runs of different scenarios "
                           "(names or file hashes differ); refused without it.")
    ] = False,
) -> None:
    """Compare runs per phase and metric. Several runs a side (A1 A2 A3 -- B1 B2): the median
    of B against the median of A beyond the variation between runs. One run a side (A B): B - A
    with a bootstrap interval over the requests, shown but not judged unless --min-runs 1.
    Exits 1 on a regression."""
    import json

    from streamquake.errors import ScenarioError
    from streamquake.reports.compare import compare_runs, to_json
    from streamquake.reports.compare import different_scenarios as differ
    from streamquake.reports.compare import markdown as compare_markdown
    from streamquake.reports.compare_terminal import print_comparison
    from streamquake.reports.saved_run import load_run

    tol = _share(tolerance, "--tolerance")
    if not 0 < confidence < 1:
        raise ScenarioError("--confidence must be between 0 and 1, e.g. 0.95")
    if min_runs < 1:
        raise ScenarioError(f"--min-runs {min_runs}: give 1 or more")
    if not 0 <= resamples <= 100_000:
        raise ScenarioError(f"--resamples {resamples}: give 0 (no intervals) to 100000; the "
                            "default 1000 bounds a 95% interval well")
    for option, out, eg in (("--markdown", markdown, "md"), ("--json", json_out, "json")):
        if out is not None and (out.is_dir() or not out.parent.is_dir()):
            raise ScenarioError(f"{option} '{out}': give a file to write in a folder that "
                                f"exists, e.g. {option} compare.{eg}")
    a_paths, b_paths = _sides(runs)
    runs_a, runs_b = [load_run(p) for p in a_paths], [load_run(p) for p in b_paths]
    for other in [*runs_a[1:], *runs_b]:
        if not different_scenarios and (why := differ(runs_a[0], other)) is not None:
            if len(runs_a) + len(runs_b) > 2:
                why = f"{why} ({runs_a[0].path} and {other.path})"
            raise ScenarioError(f"{why}, so a difference may be the scenario's, not the "
                                "target's; --different-scenarios compares them anyway")
    comparison = compare_runs(runs_a, runs_b, tolerance=tol, confidence=confidence,
                              resamples=resamples, min_runs=min_runs)
    print_comparison(comparison, console)
    if markdown is not None:
        markdown.write_text(compare_markdown(comparison))
        console.print(f"wrote {markdown}", highlight=False)
    if json_out is not None:
        json_out.write_text(json.dumps(to_json(comparison), indent=2))
        console.print(f"wrote {json_out}", highlight=False)
    raise typer.Exit(1 if comparison.worse else 0)


@app.command("history", epilog="Exit codes: 0 no regression in the latest runs, or not "
             "judged (not enough history; said); 1 a latest run regressed beyond the variation "
             "between the runs before it; 2 usage error; 3 the store cannot be read.")
def history_cmd(
    store: Annotated[Path, typer.Argument(help="The SQLite file given to `run --history`.")],
    scenario: Annotated[
        str | None, typer.Option(help="Only this scenario (default: every scenario).")
    ] = None,
    window: Annotated[
        int, typer.Option(help="The baseline: this many runs before the latest that ran to the "
                          "end; their figures' median and spread.")
    ] = 10,
    min_runs: Annotated[
        int, typer.Option(help="Judge the latest run only with at least this many earlier "
                          "runs that ran to the end (fewer: not enough history to know the "
                          "variation between runs).")
    ] = 5,
    tolerance: Annotated[str, typer.Option(help="Changes within this share of the baseline "
                                           "are no regression.")] = "10%",
    last: Annotated[int, typer.Option(help="Runs to show per scenario.")] = 10,
) -> None:
    """Trends per scenario from the history store; flags a latest run that regressed against
    the runs before it, beyond the variation between them."""
    from streamquake.reports.history import read_runs
    from streamquake.reports.history_terminal import print_history

    tol = _share(tolerance, "--tolerance")
    for option, value in (("--window", window), ("--min-runs", min_runs), ("--last", last)):
        if value < 1:
            raise ScenarioError(f"{option} {value}: give 1 or more")
    if min_runs > window:
        raise ScenarioError(f"--min-runs {min_runs} is more than --window {window}: the "
                            "latest run could never be judged")
    runs = read_runs(store, scenario)
    if scenario is not None and not runs:
        known = sorted({r.scenario for r in read_runs(store)})
        raise ScenarioError(f"--scenario {scenario}: no run of it in {store} (it holds "
                            f"{', '.join(known) if known else 'no runs yet'})")
    regressed = print_history(runs, console, window=window, tolerance=tol, last=last,
                              min_runs=min_runs)
    raise typer.Exit(1 if regressed else 0)


def _share(text: str, option: str) -> float:
    from streamquake.errors import ScenarioError

    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ScenarioError(f"{option}: {text!r} is not a share; write e.g. 10% or 0.1") from None
    if not 0 <= value < 10:
        raise ScenarioError(f"{option}: {text!r} is out of range; write e.g. 10%")
    return value


@app.command(epilog=EXIT_CODES_HELP)
def probe(
    scenario_file: Annotated[
        Path | None, typer.Argument(help="Scenario YAML file (its target, headers, classes).")
    ] = None,
    url: Annotated[str | None, typer.Option("--url", help="The server to probe (instead of, "
                                             "or over, the scenario's target.url).")] = None,
    protocol: Annotated[str, typer.Option("--protocol", help="Without a scenario: openai, "
                                          "openai_responses, gemini, anthropic, llama_cpp or "
                                          "sse.")] = "openai",
    model: Annotated[str | None, typer.Option("--model", help="Without a scenario: the model "
                                              "to ask for.")] = None,
    path: Annotated[str | None, typer.Option("--path", help="Without a scenario: the request "
                                             "path, if not the protocol's own.")] = None,
    headers: Annotated[
        list[str] | None, typer.Option("--header", help="Without a scenario: 'Name: value' "
                                       "(repeatable; ${VAR} is read from the environment).")
    ] = None,
    timeout: Annotated[str | None, typer.Option("--timeout", help="Each request's whole "
                                                "time (default: the scenario's target.timeout,"
                                                " else 60s), e.g. 10s.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document on stdout: the "
                                          "URL asked and each class's outcome.")] = False,
) -> None:
    """Send one real streaming request per request class and print what came back: the check
    `run` makes before any load, alone (an embedded target is started for it). Exits 3 when a
    class cannot stream (a 401, a 404, an HTML page, no token), 0 when every class can."""
    import json as json_module
    import tempfile

    from streamquake.run.probe import probe as probe_target
    from streamquake.scenario import load_scenario, parse_scenario

    sets = [f"target.timeout={timeout}"] if timeout else []
    if scenario_file is not None:
        scenario = load_scenario(scenario_file, [*([f"target.url={url}"] if url else []), *sets])
    elif url is None:
        raise ScenarioError("give a scenario file, or --url (with --protocol, --model, "
                            "--path and --header as needed)")
    else:
        named = dict(h.split(":", 1) for h in headers or () if ":" in h)
        bad = [h for h in headers or () if ":" not in h]
        if bad:
            raise ScenarioError(f"--header {bad[0]!r}: write it as 'Name: value'")
        target = {"protocol": protocol, "url": url,
                  "headers": {k.strip(): v.strip() for k, v in named.items()},
                  **({"model": model} if model else {}), **({"path": path} if path else {})}
        if timeout:
            target["timeout"] = timeout
        scenario = parse_scenario(json_module.dumps({
            "name": "probe", "target": target,
            "phases": {"warmup": 0, "baseline": 1, "fault": 0, "recovery": 0},
            "load": {"classes": [{"name": "probe", "prompt": "Say hello.",
                                  "max_tokens": 16}]}}), "the command line")
    with contextlib.ExitStack() as stack:
        base = scenario.target.url
        if base is None:
            # The embedded target, started as `run` starts it (and stopped after).
            from streamquake.target.process import start_target
            assert scenario.target.embedded is not None
            base = stack.enter_context(start_target(scenario.target.embedded)).url
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="sq-probe-"))
        from streamquake import protocols
        where = base.rstrip("/") + (scenario.target.path or protocols.get(
            scenario.target.protocol).path(scenario.target.model))
        if not as_json:
            console.print(f"probing {where} ({scenario.target.protocol}, timeout "
                          f"{scenario.target.timeout_s:g} s)", markup=False, highlight=False,
                          soft_wrap=True)
        probed = probe_target(scenario, base, Path(work))
    if as_json:
        _print_json({"url": where, "protocol": scenario.target.protocol,
                     "ok": all(p.problem is None for p in probed),
                     "classes": [{"class": p.cls, "ok": p.problem is None,
                                  "problem": p.problem, "status": p.sample.status,
                                  "ttfb_ms": p.sample.ttfb_ms, "ttft_ms": p.sample.ttft_ms,
                                  "content_events": p.sample.content_events,
                                  "usage_tokens": p.sample.usage_tokens,
                                  "finish_reason": p.sample.finish_reason,
                                  "model": p.sample.model} for p in probed]})
    else:
        for p in probed:
            console.print(("ok   " if p.problem is None else "FAIL ") + p.line(), markup=False,
                          highlight=False, soft_wrap=True)
    if any(p.problem is not None for p in probed):
        raise typer.Exit(3)


@app.command(epilog=EXIT_CODES_HELP)
def validate(
    scenario_file: Annotated[Path, typer.Argument(help="Scenario YAML file.")],
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override one field first, e.g. --set "
                                       "load.users=50 (repeatable).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON document on stdout: ok, problems, "
                           "warnings, and a summary of the scenario.")
    ] = False,
) -> None:
    """Check a scenario file and report every problem at once (file:line:col: field: message),
    then any warnings (settings that are valid but will not measure what they seem to)."""
    from streamquake.scenario import load_scenario
    from streamquake.scenario.advice import scenario_warnings
    from streamquake.scenario.schema import PHASE_ORDER

    try:
        scenario = load_scenario(scenario_file, overrides or [])
    except StreamquakeError as exc:
        if as_json:
            problems = getattr(exc, "problems", None) or [str(exc)]
            _print_json({"ok": False, "file": str(scenario_file), "problems": problems,
                         "warnings": []})
            raise typer.Exit(exc.exit_code) from None
        _fail(exc)
        return
    warnings = scenario_warnings(scenario)

    def when(label: str) -> str:
        steps = [s.name for s in scenario.timeline if label in s.faults]
        return ", ".join(steps) if scenario.steps is not None else steps[0]

    if as_json:
        phases = scenario.phases
        _print_json({
            "ok": True, "file": str(scenario_file), "problems": [], "warnings": warnings,
            "scenario": {
                "name": scenario.name, "duration_s": scenario.total_s,
                "protocol": scenario.target.protocol, "users": scenario.load.users,
                "phases": ({p: phases.duration_s(p) for p in PHASE_ORDER}
                           if phases is not None else None),
                "steps": [{"name": s.name, "kind": s.kind, "duration_s": s.duration_s,
                           "faults": list(s.faults)} for s in scenario.timeline],
                "faults": [{"name": f.label, "type": f.type, "phase": when(f.label),
                            "at": f.at or "local"} for f in scenario.faults],
                "slos": len(scenario.slos),
            },
        })
        return
    faults = ", ".join(f"{f.label} ({f.type}, {when(f.label)})"
                       for f in scenario.faults) or "none"
    console.print(f"{scenario_file}: OK: scenario '{scenario.name}', "
                  f"{scenario.total_s:g} s, faults: {faults}",
                  highlight=False, soft_wrap=True)
    for w in warnings:
        err_console.print(f"warning: {w}", markup=False, highlight=False, soft_wrap=True)


def _print_json(doc: object) -> None:
    import json

    print(json.dumps(doc, indent=2))


@app.command()
def recover() -> None:
    """Undo every fault the journal lists as applied and not reverted (after a killed run)."""
    from streamquake.faults.recovery import recover_all

    lines, failed = recover_all()
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
    from streamquake.protocols import names

    unknown = [p for p in protocol or [] if p not in names()]
    _port_option("--port", port)
    if not host.strip() or host != host.strip():
        raise ScenarioError(f"--host {host!r}: give an address to bind, e.g. 127.0.0.1 (0.0.0.0 "
                            "for every interface, said outright)")
    if unknown:
        raise ScenarioError(f"--protocol {unknown[0]}: the embedded target serves "
                            f"{', '.join(names())}")
    if config is not None:
        from streamquake.target.__main__ import load_config_file

        load_config_file(config)      # checked here, so errors come as the CLI's own
    args = ["--host", host, "--port", str(port)]
    for p in protocol or []:
        args += ["--protocol", p]
    if config is not None:
        args += ["--config", str(config)]
    cmd = python_module_cmd("streamquake.target", *args)
    os.execv(cmd[0], cmd)


# -- game days: faults held by agents under leases (streamquake/agent) ------------------------

AtOption = Annotated[
    str | None, typer.Option("--at", help="An agent's URL, e.g. https://gpu-host:7355 (default: "
                             "the local agent, started on first use).")]
TokenEnvOption = Annotated[
    str, typer.Option("--token-env", help="The environment variable that holds the agent's "
                      "token (with --at).")]
CaCertOption = Annotated[
    Path | None, typer.Option("--ca-cert", help="PEM CA certificate(s) that signed the agent's "
                              "certificate (https; default: the system's CAs).")]
ClientCertOption = Annotated[
    Path | None, typer.Option("--client-cert", help="A client certificate (PEM), for an agent "
                              "that asks for one (mTLS).")]
ClientKeyOption = Annotated[
    Path | None, typer.Option("--client-key", help="The client certificate's private key.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
AGENT_EXIT_CODES = ("Exit codes: 0 done; 2 a wrong parameter, or no such fault; 3 the agent is "
                    "unreachable or refused (token, allowlist, the fault's preflight, another "
                    "owner's fault); 4 a revert failed.")


def _complete_fault_type(incomplete: str) -> list[str]:
    from streamquake.faults.catalog import fault_types

    return [t for t in fault_types() if t.startswith(incomplete)]


@app.command(epilog=AGENT_EXIT_CODES)
def inject(
    fault_type: Annotated[str, typer.Argument(metavar="TYPE", help="A fault type "
                                              "(`streamquake faults` lists them).",
                                              autocompletion=_complete_fault_type)],
    params: Annotated[
        list[str] | None, typer.Argument(metavar="[KEY=VALUE]...", help="The fault's "
                                         "parameters as a scenario writes them, e.g. "
                                         "delay=100ms loss=1% (nested: stall.probability=1%).")
    ] = None,
    hold_for: Annotated[str, typer.Option("--for", help="How long to hold it: 30s, 2m, 1m30s. "
                                          "The agent reverts it then, even if this shell "
                                          "dies.")] = "",
    name: Annotated[str | None, typer.Option("--name", help="Its name, for status and "
                                             "revert (default: the type).")] = None,
    at: AtOption = None,
    target: Annotated[str | None, typer.Option("--target", help="HOST:PORT of the target, "
                                               "for faults that shape the path to it (tc).")
                      ] = None,
    token_env: TokenEnvOption = "STREAMQUAKE_AGENT_TOKEN",
    ca_cert: CaCertOption = None,
    client_cert: ClientCertOption = None,
    client_key: ClientKeyOption = None,
    as_json: JsonOption = False,
    proxy: Annotated[str | None, typer.Option("--proxy", help="The standing SSE proxy an "
                                              "sse_proxy fault goes into (`streamquake proxy`): "
                                              "HOST:PORT or its control URL (default: the one "
                                              "running here).")] = None,
) -> None:
    """Inject a fault by hand and hold it --for a while: an agent holds it under a lease, so it
    is reverted on time even if this shell is killed."""
    from streamquake.agent.commands import Where
    from streamquake.agent.commands import inject as do_inject

    where = Where(at, token_env, ca_cert, client_cert, client_key)
    if not hold_for:
        from streamquake.errors import ScenarioError

        raise ScenarioError("give --for: how long to hold the fault, e.g. --for 2m")
    do_inject(console, fault_type, list(params or []), hold_for, name, where, target,
              as_json, proxy)


@app.command(epilog=AGENT_EXIT_CODES)
def status(
    at: AtOption = None,
    token_env: TokenEnvOption = "STREAMQUAKE_AGENT_TOKEN",
    ca_cert: CaCertOption = None,
    client_cert: ClientCertOption = None,
    client_key: ClientKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """The faults an agent holds: name, type, owner, time left."""
    from streamquake.agent.commands import Where
    from streamquake.agent.commands import status as do_status

    where = Where(at, token_env, ca_cert, client_cert, client_key)
    do_status(console, where, as_json)


@app.command("revert", epilog=AGENT_EXIT_CODES)
def revert_cmd(
    name: Annotated[str | None, typer.Argument(metavar="NAME", help="The fault's name or id "
                                               "(see `streamquake status`).")] = None,
    every: Annotated[bool, typer.Option("--all", help="Revert every fault of yours the agent "
                                        "holds.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Revert it even if it belongs to "
                                        "another owner (an emergency; the agent logs it "
                                        "loudly).")] = False,
    at: AtOption = None,
    token_env: TokenEnvOption = "STREAMQUAKE_AGENT_TOKEN",
    ca_cert: CaCertOption = None,
    client_cert: ClientCertOption = None,
    client_key: ClientKeyOption = None,
) -> None:
    """Revert a held fault now, before its lease ends (or --all of them)."""
    from streamquake.agent.commands import Where
    from streamquake.agent.commands import revert as do_revert

    where = Where(at, token_env, ca_cert, client_cert, client_key)
    do_revert(console, name, every, where, force)


class _AgentCommand(_Command):
    """``agent`` takes each fault family's allowlist option (``--allow-gpus``...) as the
    families declare them (faults/contract.py ``AgentAbility``); their values travel to the
    command in ``ctx.meta["allow"]`` by option name."""

    def get_params(self, ctx: Context) -> list[Parameter]:
        params = super().get_params(ctx)
        at = len(params) - 1 if params and params[-1].name == "help" else len(params)
        return [*params[:at], *_family_allow_params(), *params[at:]]

    def invoke(self, ctx: Context) -> Any:
        ctx.meta["allow"] = {p.name.removeprefix("allow_"): ctx.params.pop(p.name)
                             for p in _family_allow_params() if p.name in ctx.params}
        return super().invoke(ctx)


@functools.cache
def _family_allow_params() -> list[Parameter]:
    """The families' ``--allow-<name>`` options, built by typer as if declared on ``agent``."""
    from streamquake.faults.catalog import allow_options

    try:
        declared = allow_options()
    except StreamquakeError:
        return []        # `agent` then fails on the catalog with the sentence that says why
    kind = list[str] | None

    def options(**values: list[str] | None) -> None: ...

    options.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter(f"allow_{o.name}", inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                          default=typer.Option(None, f"--allow-{o.name}", help=o.help))
        for o in declared])
    options.__annotations__ = {f"allow_{o.name}": kind for o in declared}
    holder = typer.Typer(add_completion=False)
    holder.command()(options)
    return typer.main.get_command(holder).params


@app.command("agent", cls=_AgentCommand,
             epilog="Exit codes: 0 stopped cleanly (every fault reverted); 1 a fault could not "
             "be reverted at stop (it stays in the journal for the next start); 2 a wrong "
             "option; 3 cannot start (port in use, state directory taken).")
def agent_cmd(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to listen on (port 0: any "
                                        "free port). Beyond loopback it needs a token.")
                      ] = "127.0.0.1:7355",
    token_env: Annotated[str, typer.Option("--token-env", help="The environment variable "
                                           "holding the bearer token clients must send.")
                         ] = "STREAMQUAKE_AGENT_TOKEN",
    allow_types: Annotated[list[str] | None, typer.Option(
        "--allow-types", help="Fault types it may apply (repeat, or comma-separate; default: "
        "all).")] = None,
    tls_cert: Annotated[Path | None, typer.Option("--tls-cert", help="Serve HTTPS with this "
                                                  "certificate (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="Its private key (PEM).")
                       ] = None,
    tls_client_ca: Annotated[Path | None, typer.Option(
        "--tls-client-ca", help="Require client certificates signed by this CA (mTLS).")
    ] = None,
    state_dir: Annotated[Path | None, typer.Option(
        "--state-dir", help="Its journal and lock (default: $STREAMQUAKE_STATE_DIR/agent, "
        "i.e. ~/.local/state/streamquake/agent).")] = None,
    discovery_file: Annotated[Path | None, typer.Option(
        "--discovery-file", hidden=True, help="Write the URL and pid here once listening.")
    ] = None,
    exit_when_idle: Annotated[str | None, typer.Option(
        "--exit-when-idle", help="Exit after this long holding nothing (e.g. 60s).")] = None,
    watch_runs: Annotated[Path | None, typer.Option(
        "--watch-runs", hidden=True, help="Watch local runs of this journal under leases "
        "(the local agent that `run` starts).")] = None,
    insecure_http: Annotated[bool, typer.Option(
        "--insecure-http", help="Take the token over plain HTTP beyond loopback (clear text on "
        "the network; an isolated lab only). Without it, that needs --tls-cert.")] = False,
) -> None:
    """Hold faults under leases for controllers (`inject --at`, scenarios with `at: NAME`):
    each fault is reverted when its lease is not renewed in time; each fault family adds its
    own `--allow-<what>` options."""
    from streamquake.agent.commands import serve_agent

    code = serve_agent(listen, token_env, allow_types, ctx.meta.get("allow", {}),
                       tls_cert, tls_key, tls_client_ca, state_dir, discovery_file,
                       exit_when_idle, watch_runs, insecure_http)
    raise typer.Exit(code)


@app.command("proxy", epilog="Exit codes: 0 stopped (every fault inside removed); 2 a wrong "
             "option; 3 cannot listen.")
def proxy_cmd(
    upstream: Annotated[str, typer.Option("--upstream", help="The URL to forward to, e.g. "
                                          "http://127.0.0.1:8000.")],
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to listen on (port 0: any "
                                        "free port).")] = "127.0.0.1:0",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the faults' random choices.")
                    ] = 0,
    upstream_insecure: Annotated[bool, typer.Option(
        "--upstream-insecure", help="Do not verify the upstream's TLS certificate.")] = False,
    read_timeout: Annotated[str, typer.Option(
        "--read-timeout", help="Longest silence from the upstream before a request fails.")
    ] = "120s",
) -> None:
    """Keep an SSE fault proxy up in front of an upstream, for game days: faults go into it
    under leases (`inject sse_proxy ... --proxy HOST:PORT`) until Ctrl-C or SIGTERM."""
    from streamquake.faults.proxy.standing import serve_standing

    code = serve_standing(upstream, listen, seed=seed, insecure=upstream_insecure,
                          read_timeout=read_timeout)
    raise typer.Exit(code)


@app.command("worker", epilog="Exit codes: 0 the run ended; 2 a wrong option; 3 no master "
             "answered within --connect-timeout; else the worst Locust worker's code.")
def worker_cmd(
    master: Annotated[str, typer.Option("--master", help="The run's master: HOST or HOST:PORT "
                                        "(its --master-bind; port 5557 by default).")],
    processes: Annotated[str, typer.Option("--processes", help="Worker processes here (N, or "
                                           "auto: one per core).")] = "1",
    connect_timeout: Annotated[str, typer.Option("--connect-timeout", help="How long to wait "
                                                 "for the master to answer (exit 3 then).")
                               ] = "60s",
) -> None:
    """Lend this host's load to a run elsewhere: Locust workers that take the plan from the
    master and send every record back to it; they exit when the run ends."""
    from streamquake.loadgen.worker import processes_option, run_workers

    code = run_workers(master, processes_option(processes),
                       _duration_option("--connect-timeout", connect_timeout))
    raise typer.Exit(code)


@app.command("faults")
def faults_cmd(as_json: JsonOption = False) -> None:
    """List the fault types and their parameters (every family the catalog finds)."""
    import json

    from rich.markup import escape
    from rich.table import Table

    from streamquake.faults.envelope import ENVELOPE
    from streamquake.reports.terminal import print_table
    from streamquake.scenario.docs import QUANTITIES, fault_docs

    docs = fault_docs()
    if as_json:
        print(json.dumps([d.to_json() for d in docs], indent=2))
        return
    console.print(f"Every fault also takes: {', '.join(ENVELOPE[1:])} (phase: warmup, "
                  "baseline, fault (default), recovery; at: local (default) or an agent's name)",
                  highlight=False, soft_wrap=True)
    for kind, how in QUANTITIES.items():
        console.print(f"{kind} parameters take {how}", markup=False, highlight=False,
                      soft_wrap=True)
    for doc in docs:
        table = Table(title=f"{doc.name} ({doc.family}): {doc.summary}", title_justify="left",
                      show_edge=False)
        for col in ("parameter", "type", "default", "notes"):
            table.add_column(col, overflow="fold")
        for p in doc.params:
            default = ("(required)" if p.required else "" if p.default is None
                       else p.default if isinstance(p.default, str) else json.dumps(p.default))
            table.add_row(*(escape(c) for c in (p.name, p.type, default, p.description)))
        print_table(table, console)


@app.command("schema")
def schema_cmd() -> None:
    """Print the scenario's JSON Schema, for editor completion (e.g. `# yaml-language-server:
    $schema=streamquake.schema.json`)."""
    import json

    from streamquake.scenario.docs import scenario_schema

    schema = scenario_schema()
    print(json.dumps(schema, indent=2))


@app.command(epilog=CAPACITY_EXIT_CODES_HELP)
def capacity(
    scenario_file: Annotated[Path, typer.Argument(help="Scenario YAML file (its target, load, "
                                                  "faults and SLOs).")],
    faults: Annotated[list[str] | None, typer.Option("--fault", help="A fault to hold, by "
                                                     "name (repeatable; default: each of the "
                                                     "scenario's).")] = None,
    start: Annotated[float | None, typer.Option("--start", help="The first rate (requests/s; "
                                                "default: load.arrival.rate, or 1).")] = None,
    precision: Annotated[str, typer.Option("--precision", help="Stop when the lowest failing "
                                           "rate is within this of the highest passing one.")
                         ] = "10%",
    max_probes: Annotated[int, typer.Option("--max-probes", help="Probes per condition at "
                                            "most.", min=1)] = 10,
    budget: Annotated[str, typer.Option("--budget", help="Time for the whole search, shared "
                                        "by the conditions.")] = "10m",
    warmup: Annotated[str, typer.Option("--warmup", help="Each probe's warm-up (an unstable "
                                        "queue builds up in it).")] = "5s",
    probe_time: Annotated[str, typer.Option("--probe", help="Each probe's measured step.")
                          ] = "20s",
    out: Annotated[Path, typer.Option("--out", help="Directory for capacity.json, summary.md, "
                                      "report.html and each probe's run.")
                   ] = Path("out-capacity"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override one scenario "
                                                        "field first (repeatable).")] = None,
    lease: Annotated[str, typer.Option("--lease", help="The watchdog's lease (as in run).")
                     ] = "10s",
    no_watchdog: Annotated[bool, typer.Option("--no-watchdog", help="Hold faults without the "
                                              "local agent's lease (as in run).")] = False,
) -> None:
    """Find the highest arrival rate at which the scenario's SLOs hold: with no fault, then
    with each fault held alone; print each capacity with its bracket, the share of the
    no-fault capacity each fault leaves, and each probe's goodput (the requests that met every
    SLO) with each condition's knee; write capacity.json, summary.md and report.html."""
    from streamquake.reports.capacity_report import search_and_report
    from streamquake.run.capacity_search import SearchPlan

    plan = SearchPlan(
        faults=tuple(faults) if faults else None, start=start,
        precision=_share(precision, "--precision"), max_probes=max_probes,
        budget_s=_duration_option("--budget", budget),
        warmup_s=_duration_option("--warmup", warmup),
        probe_s=_duration_option("--probe", probe_time),
        lease_s=None if no_watchdog else _duration_option("--lease", lease))
    if start is not None and start <= 0:
        raise ScenarioError(f"--start {start:g}: give a rate above 0 requests/s")
    text = _read_scenario(scenario_file)
    _check_out_dir(out)
    raise typer.Exit(search_and_report(scenario_file, text, overrides or [], out, plan,
                                       _console))


class _ReaderGone:
    """stdout or stderr that outlives its reader: ``run ... | tee log`` and Ctrl-C stops tee
    with the run (one process group), and the run's next line then raised BrokenPipeError, so
    an interrupted run wrote no report and exited 1. Once the reader is gone, the command goes
    on, and what this stream would show goes to ``KEPT_OUTPUT`` in the state directory (its
    descriptor points there; /dev/null where that cannot be opened): the end of a run whose
    reader left, an error included, can still be read."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _lost(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            kept = _kept_output()
            os.dup2(kept, self._stream.fileno())    # a later flush of its buffer lands here
            os.close(kept)

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._lost()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


KEPT_OUTPUT = "output-after-its-reader-left.log"


def _kept_output() -> int:
    """A descriptor appending to ``KEPT_OUTPUT`` (headed by this process and the time), or to
    /dev/null where the state directory cannot take it."""
    try:
        directory = state_dir()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / KEPT_OUTPUT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return os.open(os.devnull, os.O_WRONLY)
    os.write(fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                 f"{' '.join(sys.argv[1:3])}: the reader of its output went away; what it "
                 "showed after that follows\n".encode())
    return fd


def main() -> None:
    # Arguments that are not UTF-8 arrive as surrogates (PEP 383); echoing one must not end
    # the command in a traceback.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    sys.stdout = _ReaderGone(sys.stdout)
    sys.stderr = _ReaderGone(sys.stderr)
    try:
        app()
    except StreamquakeError as exc:
        # Every command's errors end here: "Error: <sentence>" and the error's own exit code
        # (the traceback only under --debug).
        try:
            _fail(exc)
        except typer.Exit as done:
            sys.exit(done.exit_code)
