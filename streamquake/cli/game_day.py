"""Game days: ``recover``, ``target serve``, faults held by agents (``inject``, ``status``,
``revert``, ``agent``, ``proxy``) and Locust workers lent to a run elsewhere (``worker``)."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from streamquake.cli.base import (
    Command,
    JsonOption,
    app,
    console,
    duration_option,
    port_option,
    target_app,
)
from streamquake.errors import ScenarioError, StreamquakeError

if TYPE_CHECKING:
    from typer._click import Context, Parameter


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

    from streamquake.procs import python_module_cmd
    from streamquake.protocols import names

    unknown = [p for p in protocol or [] if p not in names()]
    port_option("--port", port)
    if not host.strip() or host != host.strip():
        raise ScenarioError(f"--host {host!r}: give an address to bind, e.g. 127.0.0.1 (0.0.0.0 "
                            "for every interface, said outright)")
    if unknown:
        raise ScenarioError(f"--protocol {unknown[0]}: the embedded target serves "
                            f"{', '.join(names())}")
    if config is not None:
        from streamquake.embedded.__main__ import load_config_file

        load_config_file(config)      # checked here, so errors come as the CLI's own
    args = ["--host", host, "--port", str(port)]
    for p in protocol or []:
        args += ["--protocol", p]
    if config is not None:
        args += ["--config", str(config)]
    cmd = python_module_cmd("streamquake.embedded", *args)
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


class _AgentCommand(Command):
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
                       duration_option("--connect-timeout", connect_timeout))
    raise typer.Exit(code)


