"""The agent's HTTP server (aiohttp): bearer-token auth compared in constant time, TLS and
optional mTLS, JSON errors as sentences, and the watchdog running next to it.

Listening beyond loopback needs a token (read from the environment variable ``--token-env``
names, never from the command line, where ``ps`` would show it), and TLS to carry it, unless
``--insecure-http`` accepts a token in clear text (said loudly, on stderr and in the log). One
agent per state directory (a lock file): two would share a journal and undo each other's work
at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import itertools
import json
import os
import re
import signal
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, ValidationError

from streamquake.agent.holder import AgentError, Holder
from streamquake.agent.policy import Allowlist
from streamquake.agentwire.api import (
    API_VERSION,
    MAX_JSON_DEPTH,
    OWNER_KEY_HEADER,
    AgentInfo,
    ApplyRequest,
    Problem,
    Problems,
    Renew,
    WatchRun,
)
from streamquake.errors import ScenarioError, StreamquakeError, validation_sentences
from streamquake.faults.catalog import allow_options, families, fault_types
from streamquake.journal import Journal, pid_start_time
from streamquake.loopback import is_loopback
from streamquake.version import __version__

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HOLDER: web.AppKey[Holder] = web.AppKey("holder", Holder)
INFO: web.AppKey[AgentInfo] = web.AppKey("info", AgentInfo)
B = TypeVar("B", bound=BaseModel)


@dataclass
class AgentConfig:
    host: str
    port: int
    token: str | None
    token_env: str
    allow: Allowlist
    state_dir: Path
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    discovery_file: Path | None = None     # where a local daemon says its URL (inject finds it)
    idle_exit_s: float | None = None
    runs_journal: Path | None = None       # watch local runs of this journal (/v1/runs)
    insecure_http: bool = False            # a token over plain HTTP beyond loopback: accepted

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    @property
    def plain_token_beyond_loopback(self) -> bool:
        return self.token is not None and self.tls_cert is None and not is_loopback(self.host)


def parse_listen(text: str) -> tuple[str, int]:
    """``127.0.0.1:7355``, ``[::1]:7355``, ``0.0.0.0:0``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ScenarioError(f"--listen {text!r}: give HOST:PORT, e.g. 127.0.0.1:7355 or "
                            "[::1]:7355 (port 0: any free port)")
    return host.strip("[]"), int(port)


def check_config(cfg: AgentConfig) -> None:
    """Every problem with the configuration at once, before anything listens."""
    problems = []
    if cfg.token is None and not is_loopback(cfg.host):
        problems.append(f"refusing to listen on {cfg.host} without a token: anyone who can reach "
                        f"it could apply faults; export ${cfg.token_env} (e.g. `export "
                        f"{cfg.token_env}=$(openssl rand -hex 32)`), or listen on 127.0.0.1")
    if cfg.plain_token_beyond_loopback and not cfg.insecure_http:
        problems.append(f"refusing to take a bearer token over plain HTTP on {cfg.host}: anyone "
                        "on the network path could read it and apply faults; give --tls-cert "
                        "and --tls-key, or --insecure-http to accept that (an isolated lab "
                        "network), or listen on 127.0.0.1")
    if cfg.token is not None and len(cfg.token) < 16:
        problems.append(f"${cfg.token_env} is shorter than 16 characters: use a long random "
                        "token, e.g. `openssl rand -hex 32`")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        problems.append("give both --tls-cert and --tls-key, or neither")
    if cfg.tls_client_ca is not None and cfg.tls_cert is None:
        problems.append("--tls-client-ca (mTLS) needs TLS: give --tls-cert and --tls-key too")
    for flag, path in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key),
                       ("--tls-client-ca", cfg.tls_client_ca)):
        if path is not None and not path.is_file():
            problems.append(f"{flag} {path}: no such file")
    if problems:
        raise ScenarioError(problems)


def ssl_context(cfg: AgentConfig) -> ssl.SSLContext | None:
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        if cfg.tls_client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=cfg.tls_client_ca)
    except (ssl.SSLError, OSError) as exc:
        raise ScenarioError(f"cannot load the TLS files ({exc}): --tls-cert must be a PEM "
                            "certificate, --tls-key its private key, --tls-client-ca PEM CA "
                            "certificates") from exc
    return ctx


@contextlib.contextmanager
def state_dir_lock(state_dir: Path) -> Iterator[None]:
    path = state_dir / "agent.lock"
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fh = open(path, "a+")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise ScenarioError(f"--state-dir {state_dir}: cannot hold the agent's state there "
                            f"({exc.strerror or exc}); give a directory this user can write, "
                            "or a path that does not exist yet") from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            other = fh.read().strip() or "unknown"
            raise StreamquakeError(
                f"another agent uses the state directory {state_dir} (pid {other}): stop it, "
                "or give this one its own --state-dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield


def printable(text: str) -> str:
    """``text`` with each control or line-separating character escaped (``\\n``, ``\\x1b``,
    ``\\u2028``): what a request sent (an owner, a fault's name) can never forge a log line or
    move the terminal's cursor."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _log_to(stream: IO[str]) -> Callable[[str], None]:
    def log(line: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
        print(f"{stamp} agent: {printable(line)}", file=stream, flush=True)

    return log


# -- the HTTP surface --------------------------------------------------------------------------


def _answer(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _problem(status: int, error: str, headers: dict[str, str] | None = None) -> web.Response:
    resp = _answer(Problem(error=error), status)
    resp.headers.update(headers or {})
    return resp


def _auth(token: str | None, token_env: str) -> Middleware:
    expected = f"Bearer {token}".encode() if token is not None else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _problem(401, "missing or wrong token: send `Authorization: Bearer "
                                f"<token>` with the token the agent reads from ${token_env}",
                                {"WWW-Authenticate": 'Bearer realm="streamquake-agent"'})
        request.app[HOLDER].touch()
        try:
            return await handler(request)
        except AgentError as exc:
            body = Problem(error=exc.error, problems=exc.problems, ended=exc.ended)
            return _answer(body, exc.status)
        except web.HTTPException as exc:
            return _problem(exc.status, f"{request.method} {request.path}: {exc.reason}")

    return middleware


# A string, or an unterminated one to the end: always matching at the first try keeps the scan
# linear (a closing quote required would rescan the rest of the body from every quote).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.?)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_NESTING_STEP = [1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256)]


def _json_depth(raw: bytes) -> int:
    """How deep ``raw`` nests, by a linear scan in C loops (at most ~60 ms for 256 KiB here):
    the json module parses nesting by recursion, so 100,000 levels would be a RecursionError."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_NESTING_STEP.__getitem__, brackets)), default=0)


async def _body(request: web.Request) -> object:
    raw = await request.read()
    if _json_depth(raw) > MAX_JSON_DEPTH:
        raise AgentError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels: "
                         "send the fault as a scenario writes it")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AgentError(400, "the request body is not JSON") from None


def _owner_key(request: web.Request) -> str | None:
    return request.headers.get(OWNER_KEY_HEADER)


def _force(request: web.Request) -> bool:
    given = request.query.get("force")
    if given not in (None, "true", "false"):
        raise AgentError(400, f"force={given}: give force=true (revert another owner's fault) "
                         "or leave it out")
    return given == "true"


def _parsed(model: type[B], raw: object) -> B:
    """A request body as ``model``, or 400 with one sentence per problem."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = validation_sentences(exc)
        raise AgentError(400, "; ".join(problems), problems) from None


def _apply_request(raw: object) -> ApplyRequest:
    return _parsed(ApplyRequest, raw)


async def _renew_body(request: web.Request) -> Renew:
    return _parsed(Renew, await _body(request) if request.can_read_body else {})


async def _info(request: web.Request) -> web.Response:
    info = request.app[INFO].model_copy(update={
        "held": request.app[HOLDER].held_count(),
        "recovered": request.app[HOLDER].recovered,
    })
    return _answer(info)


async def _preflight(request: web.Request) -> web.Response:
    req = _apply_request(await _body(request))
    return _answer(Problems(problems=await request.app[HOLDER].preflight(req)))


async def _apply(request: web.Request) -> web.Response:
    req = _apply_request(await _body(request))
    key = _owner_key(request)
    if key is None or not 16 <= len(key) <= 256:
        raise AgentError(400, f"send an owner key: the header {OWNER_KEY_HEADER} with 16 to 256 "
                         "random characters (e.g. `openssl rand -hex 16`); renewing and "
                         "reverting the fault need the same key")
    return _answer(await request.app[HOLDER].apply(req, key), 201)


async def _list(request: web.Request) -> web.Response:
    from streamquake.agentwire.api import HeldFaults

    holder = request.app[HOLDER]
    return _answer(HeldFaults(host=holder.host, faults=holder.faults()))


async def _renew(request: web.Request) -> web.Response:
    renew = await _renew_body(request)
    return _answer(request.app[HOLDER].renew(request.match_info["key"], renew.lease_s,
                                             _owner_key(request)))


async def _revert(request: web.Request) -> web.Response:
    return _answer(await request.app[HOLDER].revert(request.match_info["key"],
                                                    _owner_key(request), _force(request)))


async def _revert_all(request: web.Request) -> web.Response:
    answer = await request.app[HOLDER].revert_all(_owner_key(request), _force(request))
    return _answer(answer, 500 if answer.failed else 200)


def _run_answer(call: Callable[[], BaseModel], status: int = 200) -> web.Response:
    from streamquake.agent.runs import RunWatchError

    try:
        return _answer(call(), status)
    except RunWatchError as exc:
        raise AgentError(exc.status, exc.error) from None


async def _watch_run(request: web.Request) -> web.Response:
    req = _parsed(WatchRun, await _body(request))
    holder = request.app[HOLDER]
    holder.touch()
    return _run_answer(lambda: holder.runs.watch(req), 201)


async def _renew_run(request: web.Request) -> web.Response:
    renew = await _renew_body(request)
    holder = request.app[HOLDER]
    return _run_answer(lambda: holder.runs.renew(request.match_info["key"], renew.lease_s))


async def _end_run(request: web.Request) -> web.Response:
    holder = request.app[HOLDER]
    holder.touch()
    return _run_answer(lambda: holder.runs.end(request.match_info["key"]))


def build_app(holder: Holder, info: AgentInfo, cfg: AgentConfig) -> web.Application:
    app = web.Application(middlewares=[_auth(cfg.token, cfg.token_env)],
                          client_max_size=256 * 1024)
    app[HOLDER] = holder
    app[INFO] = info
    app.router.add_get("/v1/info", _info)
    app.router.add_post("/v1/preflight", _preflight)
    app.router.add_get("/v1/faults", _list)
    app.router.add_post("/v1/faults", _apply)
    app.router.add_delete("/v1/faults", _revert_all)
    app.router.add_post("/v1/faults/{key}/renew", _renew)
    app.router.add_delete("/v1/faults/{key}", _revert)
    app.router.add_post("/v1/runs", _watch_run)
    app.router.add_post("/v1/runs/{key}/renew", _renew_run)
    app.router.add_delete("/v1/runs/{key}", _end_run)
    return app


# -- running it --------------------------------------------------------------------------------


def _capabilities() -> dict[str, bool]:
    found = {"root": os.geteuid() == 0}
    for family in families():
        found.update(family.agent.capabilities())
    return found


def _unavailable(types: list[str]) -> dict[str, str]:
    """Fault types whose injector cannot even load here (a missing library)."""
    out = {}
    for name in types:
        try:
            fault_types()[name].injector()
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: other types still work
            out[name] = f"cannot load its injector: {exc}"
    return out


def _write_discovery(path: Path, url: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "pid": os.getpid(), "pid_start": pid_start_time(os.getpid())},
                  fh)
    os.replace(tmp, path)


def _remove_discovery(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def serve(cfg: AgentConfig) -> int:
    """Run the agent until SIGTERM/SIGINT/SIGHUP (or idle, for a local daemon); revert
    everything held on the way out. Returns the exit code."""
    check_config(cfg)
    tls = ssl_context(cfg)
    log = _log_to(sys.stdout)
    with state_dir_lock(cfg.state_dir):
        journal = Journal(cfg.state_dir / "journal.json")
        holder = Holder(journal, cfg.allow, cfg.state_dir, log, cfg.idle_exit_s,
                        cfg.runs_journal)
        holder.recover_at_start()
        return asyncio.run(_serve(cfg, holder, tls, log))


async def _serve(cfg: AgentConfig, holder: Holder, tls: ssl.SSLContext | None,
                 log: Callable[[str], None]) -> int:
    loop = asyncio.get_running_loop()
    types = sorted(cfg.allow.types)
    capabilities = await loop.run_in_executor(None, _capabilities)
    info = AgentInfo(
        api=API_VERSION, version=__version__, host=holder.host, pid=os.getpid(),
        started_at=time.time(), state_dir=str(cfg.state_dir), allow=cfg.allow.view(),
        fault_types={t: fault_types()[t].summary for t in types},
        unavailable=await loop.run_in_executor(None, _unavailable, types),
        capabilities=capabilities, recovered=holder.recovered, held=0,
    )
    runner = web.AppRunner(build_app(holder, info, cfg), access_log=None,
                           handle_signals=False, shutdown_timeout=40.0)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=tls)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise StreamquakeError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}"
                               ) from exc
    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"{cfg.scheme}://{shown}:{port}"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    auth = f"bearer token from ${cfg.token_env}" if cfg.token else "none (loopback only)"
    tls_said = ("mTLS" if cfg.tls_client_ca else "TLS") if tls else "plain HTTP"
    log(f"streamquake {__version__} agent on {holder.host}, pid {os.getpid()}: {url} "
        f"({tls_said}; auth: {auth}); state {cfg.state_dir}")
    if cfg.plain_token_beyond_loopback:
        warning = (f"WARNING: INSECURE: the bearer token from ${cfg.token_env} travels in clear "
                   f"text over plain HTTP on {cfg.host} (--insecure-http): anyone on the "
                   "network path can read it and apply faults; use --tls-cert and --tls-key")
        log(warning)
        print(f"\n{'!' * 72}\n{warning}\n{'!' * 72}\n", file=sys.stderr, flush=True)
    log("; ".join([f"allowed: types {', '.join(types)}", *(
        f"{o.title} {', '.join(sorted(v)) if (v := cfg.allow.options.get(o.name)) else 'any'}"
        for o in allow_options())]))
    if cfg.discovery_file is not None:
        _write_discovery(cfg.discovery_file, url)
    print(f"LISTENING {url}", flush=True)
    try:
        await holder.watch(stop)
    finally:
        if cfg.discovery_file is not None:
            _remove_discovery(cfg.discovery_file)
        # Stop listening first (answering what is in flight), so nothing new is applied
        # after everything held has been reverted.
        await runner.cleanup()
        answer = await holder.shutdown()
        for r in answer.reverted:
            log(f"stopping: reverted {r.name}")
        for line in answer.failed:
            log(f"stopping: WARNING: {line}; it stays in the journal for the next start")
    log("stopped")
    return 1 if answer.failed else 0
