"""``streamquake compare`` and ``history``: runs set against each other."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from streamquake.cli.base import (
    Command,
    app,
    console,
    share_option,
)
from streamquake.errors import ScenarioError

if TYPE_CHECKING:
    from typer._click import Context


# ``compare A1 A2 -- B1 B2``: click takes ``--`` for the end of the options and drops it, so the
# sides would be lost; it is swapped for this marker first. A NUL cannot be in an argument, so
# no path is ever taken for it.
_B_SIDE = "\0--"


class _SidesCommand(Command):
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

    tol = share_option(tolerance, "--tolerance")
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

    tol = share_option(tolerance, "--tolerance")
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


