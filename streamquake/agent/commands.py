"""What ``streamquake inject``, ``status``, ``revert`` and ``agent`` do; ``cli.py`` only parses
the command line and calls these. Errors are ``StreamquakeError`` sentences with the CLI's
exit codes: 2 a wrong command line or parameter, 3 an agent that is unreachable or refuses (no
token, outside its allowlist, the fault's own preflight, another owner's fault), 4 a revert that
failed."""

from __future__ import annotations

import difflib
import getpass
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, JsonValue, ValidationError
from rich.console import Console
from rich.table import Table

from streamquake.agent.local import ensure_local_agent, find_local_agent, local_orphans
from streamquake.agent.params import parse_assignments
from streamquake.agentwire.api import ApplyRequest, Reverted, TargetAddr
from streamquake.agentwire.client import (
    AgentClient,
    AgentRefused,
    AgentUnreachable,
    TlsFiles,
    token_from_env,
)
from streamquake.errors import (
    InjectorError,
    RevertError,
    ScenarioError,
    StreamquakeError,
    validation_sentences,
)
from streamquake.faults.catalog import fault_types, standing_for, standings
from streamquake.faults.written import settings_text
from streamquake.units import format_clock, format_duration, parse_duration_s


@dataclass(frozen=True)
class Where:
    """``--at URL`` and how to reach it; ``url`` None: the local agent."""

    url: str | None = None
    token_env: str = "STREAMQUAKE_AGENT_TOKEN"
    ca_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    @property
    def label(self) -> str:
        return self.url or "local"

    def client(self, start: bool) -> AgentClient | None:
        """A client for the agent; locally, None when none runs and ``start`` is False."""
        if self.url is not None:
            return AgentClient(self.url, token_from_env(self.token_env),
                               tls=TlsFiles(self.ca_cert, self.client_cert, self.client_key))
        if start:
            return ensure_local_agent().client()
        found = find_local_agent()
        return found.client() if found is not None else None


def _print_json(console: Console, model: BaseModel | dict[str, JsonValue]) -> None:
    # Plain print: rich would read ":name:" in a string as an emoji code.
    print(model.model_dump_json(indent=2) if isinstance(model, BaseModel)
          else json.dumps(model, indent=2), flush=True)


def _refused(exc: AgentRefused) -> StreamquakeError:
    """An agent's refusal with the CLI's exit code: 2 for what the user must change in the
    command, 3 for the environment (token, allowlist, the fault's own preflight)."""
    if exc.status in (400, 404, 409):
        return ScenarioError(str(exc))
    if exc.status == 500:
        return RevertError(str(exc))
    return InjectorError(str(exc))


def _parse_target(text: str | None) -> TargetAddr | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if (not sep or not host or not port.isascii() or not port.isdigit() or len(port) > 5
            or not 0 < int(port) <= 65535):
        raise ScenarioError(f"--target {text[:80]!r}: give HOST:PORT (a port 1-65535), e.g. "
                            "10.0.0.7:8000")
    return TargetAddr(host=host.strip("[]"), port=int(port))


def build_fault(type_name: str, words: list[str], name: str | None,
                has_target: bool = False) -> dict[str, JsonValue]:
    """The fault as a scenario would write it, validated here first (exit 2, before any agent
    is started or asked); one that acts on the path to a target needs ``--target``."""
    known = fault_types()
    if type_name not in known:
        raise ScenarioError(f"no fault family offers type {type_name!r}; known: "
                            f"{', '.join(known)} (`streamquake faults` lists their parameters)")
    fault = parse_assignments(type_name, words)
    if name is not None:
        fault["name"] = name
    for key in ("at", "phase"):
        if key in fault:
            raise ScenarioError(f"{key}=... does not apply to inject: "
                                + ("use --at URL" if key == "at" else "it lasts --for"))
    try:
        spec = known[type_name].spec.model_validate(fault)
    except ValidationError as exc:
        model = known[type_name].spec
        allowed = sorted({f.alias or n for n, f in model.model_fields.items()}
                         - {"at", "phase", "type"})
        problems = []
        for err, sentence in zip(exc.errors(include_url=False),
                                 validation_sentences(exc, type_name), strict=True):
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                word = str(err["loc"][0])
                close = difflib.get_close_matches(word, allowed, n=1)
                sentence = (f"{type_name} has no parameter {word!r}: "
                            + (f"did you mean {close[0]!r}? " if close else "")
                            + f"its parameters: {', '.join(allowed)}")
            problems.append(sentence)
        raise ScenarioError(problems) from None
    needs_target = known[type_name].needs_target
    if not has_target and needs_target is not None and (why := needs_target(spec)):
        raise ScenarioError(why)
    return fault


def _standing_url(type_name: str, given: str | None, where: Where) -> str | None:
    """The control URL of the standing resource (a standing SSE proxy) a fault of this type goes
    into: ``--proxy``, or else the one of its kind that runs here."""
    standing = standing_for(type_name)
    if standing is None:
        if given is not None:
            what = " or ".join(f"a {s.what}, for {', '.join(sorted(s.types))} faults"
                               for s in standings()) or "a standing resource"
            raise ScenarioError(f"--proxy names {what}; leave it out for {type_name}")
        return None
    if given is not None:
        try:
            return standing.control_url(given)
        except ValueError as exc:
            raise ScenarioError(f"--proxy: {exc}") from None
    if where.url is not None:
        raise ScenarioError(f"with --at, name the {standing.what} the fault goes into: "
                            "--proxy HOST:PORT, as the agent's host reaches it")
    found = standing.running()
    if not found:
        raise InjectorError(f"no {standing.what} runs here for {type_name} faults to act in: "
                            f"start one with `{standing.start_hint}` (it prints its address), "
                            "send the traffic through it, and inject again")
    if len(found) > 1:
        listed = ", ".join(f"{p.address} (-> {p.upstream})" for p in found)
        raise ScenarioError(f"{len(found)} {standing.plural} run here: {listed}; name one "
                            "with --proxy HOST:PORT")
    return found[0].control_url


def inject(console: Console, type_name: str, words: list[str], lease: str, name: str | None,
           where: Where, target: str | None, as_json: bool, proxy: str | None = None) -> None:
    fault = build_fault(type_name, words, name, has_target=target is not None)
    try:
        lease_s = parse_duration_s(lease)
    except ValueError as exc:
        raise ScenarioError(f"--for: {exc}") from None
    if lease_s <= 0:
        raise ScenarioError("--for must be longer than 0 s, e.g. --for 2m")
    control_url = _standing_url(type_name, proxy, where)
    owner = f"{getpass.getuser()}@{socket.gethostname()} (inject, pid {os.getpid()})"
    req = ApplyRequest(fault=fault, lease=lease_s, owner=owner, target=_parse_target(target),
                       proxy=control_url)
    client = where.client(start=True)
    assert client is not None
    asked = time.monotonic()
    try:
        try:
            held = client.apply(req)
        except AgentUnreachable:
            if where.url is not None:
                raise
            # The local agent left between finding it and asking it (idle exit): start anew.
            held = ensure_local_agent().client().apply(req)
    except AgentRefused as exc:
        raise _refused(exc) from exc
    if as_json:
        _print_json(console, held)
        return
    at = "the local agent" if where.url is None else f"the agent at {where.url}"
    if control_url is not None and (standing := standing_for(type_name)) is not None:
        at += (f" into the {standing.what.removeprefix('standing ')} at "
               f"{standing.address(control_url)}")
    console.print(f"injected {held.name} ({held.type}) on {held.host} through {at}: held for "
                  f"{format_duration(held.lease_s)}, until {format_clock(held.expires_at)}; revert "
                  f"early with `streamquake revert {held.name}"
                  f"{'' if where.url is None else ' --at ' + where.url}`",
                  markup=False, highlight=False, soft_wrap=True)
    # One line for people; --json (and `status --json`) has the agent's whole record.
    spec = fault_types()[type_name].spec.model_validate(fault)
    toward = f" toward {target}" if target else ""
    console.print(f"in place {(time.monotonic() - asked) * 1000:.0f} ms after asking: "
                  f"{held.type} {settings_text(spec)}{toward}", markup=False, highlight=False,
                  soft_wrap=True)


def _no_local_agent(console: Console, as_json: bool, what: str) -> bool:
    """No local agent runs: start one anyway if a killed one left faults (it undoes them at
    start, and we show what it did). Returns True when that was the case."""
    if local_orphans() == 0:
        if as_json:
            _print_json(console, {"at": "local", "host": socket.gethostname(), "faults": []})
        else:
            console.print(f"{what}: the local agent is not running, so it holds no fault",
                          highlight=False)
        return False
    client = ensure_local_agent().client()
    for line in client.info().recovered:
        console.print(f"the local agent was killed with faults held; at its restart it {line}",
                      markup=False, highlight=False, soft_wrap=True)
    return True


def status(console: Console, where: Where, as_json: bool) -> None:
    client = where.client(start=False)
    if client is None and not _no_local_agent(console, as_json, "nothing held"):
        return
    client = client or where.client(start=False)
    assert client is not None
    try:
        held = client.faults()
    except AgentRefused as exc:
        raise _refused(exc) from exc
    if as_json:
        _print_json(console, {"at": where.label, "host": held.host,
                              "faults": [f.model_dump(mode="json") for f in held.faults]})
        return
    if not held.faults:
        console.print(f"nothing held by the agent on {held.host} ({where.label})",
                      highlight=False)
        return
    table = Table(title=f"faults held on {held.host} ({where.label})", title_justify="left")
    for col in ("name", "type", "settings", "owner", "left", "until", "renewals", "state"):
        table.add_column(col, no_wrap=col not in ("owner", "settings"))
    for f in held.faults:
        settings = _settings(f.type, f.spec)
        table.add_row(f.name, f.type, settings or "-", f.owner or "-",
                      format_duration(f.remaining_s), format_clock(f.expires_at),
                      str(f.renewals), f.state + (f": {f.error}" if f.error else ""))
    console.print(table)


def _settings(type_name: str, spec: dict[str, JsonValue]) -> str:
    """A held fault's parameters as a scenario writes them (``rate=1mbit latency=50ms``)."""
    family = fault_types().get(type_name)
    try:
        if family is not None:
            return settings_text(family.spec.model_validate(spec))
    except ValidationError:
        pass       # a family of another version: its fields as they came
    return " ".join(f"{k}={v}" for k, v in spec.items() if k not in ("type", "name", "phase"))


def _said(r: Reverted) -> str:
    return (f"reverted {r.name} ({r.type}) on {r.host}, held "
            f"{format_duration(r.reverted_at - r.applied_at)}: {_readable(r.reverted)}")


def _readable(value: JsonValue) -> str:
    """What a revert reported, as words: ``removed: a, b; took 14 ms`` (it was raw JSON)."""
    if not isinstance(value, dict):
        return json.dumps(value)
    parts = []
    for k, v in value.items():
        if k.endswith("_ms") and isinstance(v, int | float) and not isinstance(v, bool):
            parts.append(f"{'took' if k == 'revert_ms' else k.removesuffix('_ms')} {v:.0f} ms")
        elif isinstance(v, list):
            parts.append(f"{k}: " + (", ".join(str(x) for x in v) if v else "nothing"))
        elif isinstance(v, bool):
            parts.append(f"{k}: {'yes' if v else 'no'}")
        elif isinstance(v, dict):
            parts.append(f"{k}: {json.dumps(v, separators=(', ', ': '))}")
        else:
            parts.append(f"{k}: {v}")
    return "; ".join(parts) or "nothing to undo"


def revert(console: Console, key: str | None, every: bool, where: Where,
           force: bool = False) -> None:
    if (key is None) == (not every):
        raise ScenarioError("give a fault's NAME (see `streamquake status`) or --all")
    client = where.client(start=False)
    if client is None and not _no_local_agent(console, False, "nothing to revert"):
        return
    client = client or where.client(start=False)
    assert client is not None
    try:
        if key is not None:
            console.print(_said(client.revert(key, force=force)), markup=False,
                          highlight=False, soft_wrap=True)
            return
        answer = client.revert_all(force=force)
    except AgentRefused as exc:
        ended = exc.problem.ended
        if exc.status == 410 and ended is not None:
            console.print(f"{ended.name} was already reverted at {format_clock(ended.reverted_at)} "
                          f"({ended.by}): {_readable(ended.reverted)}", markup=False,
                          highlight=False, soft_wrap=True)
            return
        raise _refused(exc) from exc
    for r in answer.reverted:
        console.print(_said(r), markup=False, highlight=False, soft_wrap=True)
    if not answer.reverted and not answer.failed and not answer.skipped:
        console.print("nothing was held", highlight=False)
    if answer.failed:
        raise RevertError("; ".join(answer.failed))
    if answer.skipped:
        raise InjectorError("left held, as each belongs to another owner: "
                            f"{', '.join(answer.skipped)}; in an emergency, `streamquake revert "
                            "--all --force` reverts them too")


def serve_agent(listen: str, token_env: str, allow_types: list[str] | None,
                allow_options: Mapping[str, list[str] | None],
                tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None,
                state_dir: Path | None, discovery_file: Path | None,
                exit_when_idle: str | None, watch_runs: Path | None = None,
                insecure_http: bool = False) -> int:
    from streamquake.agent.http_api import AgentConfig, parse_listen, serve
    from streamquake.agent.policy import Allowlist
    from streamquake.journal import state_dir as default_state_dir

    host, port = parse_listen(listen)
    try:
        allow = Allowlist.build(fault_types(), allow_types, allow_options)
        idle_s = parse_duration_s(exit_when_idle) if exit_when_idle else None
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None
    cfg = AgentConfig(host=host, port=port, token=token_from_env(token_env),
                      token_env=token_env, allow=allow,
                      state_dir=state_dir or default_state_dir() / "agent",
                      tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
                      discovery_file=discovery_file, idle_exit_s=idle_s,
                      runs_journal=watch_runs, insecure_http=insecure_http)
    return serve(cfg)
