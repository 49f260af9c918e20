"""What every command shares: the app, its consoles, exit codes, errors and option
checks. The commands live in the modules beside this one, by group."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup, TyperOption

from streamquake.errors import ScenarioError, StreamquakeError

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


class Command(TyperCommand):
    def get_params(self, ctx: Context) -> list[Parameter]:
        return _plain_flags(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Context) -> list[Parameter]:
        return _plain_flags(super().get_params(ctx))


class _Typer(typer.Typer):
    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        return super().command(*args, **{"cls": Command, **kwargs})


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


def print_problems(exc: StreamquakeError) -> None:
    if _state["debug"]:
        err_console.print_exception()
    for line in getattr(exc, "problems", None) or [str(exc)]:
        err_console.print(f"Error: {line}", markup=False, highlight=False, emoji=False,
                          soft_wrap=True)


def fail(exc: StreamquakeError) -> None:
    print_problems(exc)
    raise typer.Exit(exc.exit_code)


def port_option(name: str, port: int) -> int:
    if not 0 <= port <= 65535:
        raise ScenarioError(f"{name} {port}: a port is 1 to 65535 (0: any free port)")
    return port


def read_scenario(path: Path) -> bytes:
    from streamquake.located_yaml import read_file

    return read_file(path, "scenario file")


def duration_option(name: str, text: str) -> float:
    from streamquake.units import parse_duration_s

    try:
        value = parse_duration_s(text)
    except ValueError as exc:
        raise ScenarioError(f"{name} {text}: {exc}") from None
    if value <= 0:
        raise ScenarioError(f"{name} {text}: must be longer than 0 s, e.g. {name} 10s")
    return value


def check_out_dir(out: Path) -> None:
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


def share_option(text: str, option: str) -> float:
    from streamquake.errors import ScenarioError

    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ScenarioError(f"{option}: {text!r} is not a share; write e.g. 10% or 0.1") from None
    if not 0 <= value < 10:
        raise ScenarioError(f"{option}: {text!r} is out of range; write e.g. 10%")
    return value


def print_json(doc: object) -> None:
    import json

    print(json.dumps(doc, indent=2))


JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
