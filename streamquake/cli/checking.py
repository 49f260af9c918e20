"""``streamquake probe`` and ``validate``: a target and a scenario checked before a run."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from streamquake.cli.base import (
    EXIT_CODES_HELP,
    app,
    console,
    err_console,
    fail,
    print_json,
)
from streamquake.errors import ScenarioError, StreamquakeError


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
            from streamquake.embedded.process import start_target
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
        print_json({"url": where, "protocol": scenario.target.protocol,
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
            print_json({"ok": False, "file": str(scenario_file), "problems": problems,
                         "warnings": []})
            raise typer.Exit(exc.exit_code) from None
        fail(exc)
        return
    warnings = scenario_warnings(scenario)

    def when(label: str) -> str:
        steps = [s.name for s in scenario.timeline if label in s.faults]
        return ", ".join(steps) if scenario.steps is not None else steps[0]

    if as_json:
        phases = scenario.phases
        print_json({
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


