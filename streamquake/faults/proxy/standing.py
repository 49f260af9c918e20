"""A standing SSE proxy (``streamquake proxy``): one a person starts in front of an upstream and
keeps up through a game day, taking faults at run time through its control API, the way
Toxiproxy keeps a proxy up and takes toxics.

Faults go into it under leases like any hand-held fault (``streamquake inject sse_proxy ...``):
the agent holding the lease applies and reverts them through the control API, with the
injector a run uses (the proxy is the fault's context, ``FaultProxy.attached``). While it runs,
it says where it listens in ``$STREAMQUAKE_STATE_DIR/proxies/<pid>.json``, so ``inject`` on this
host finds it without ``--proxy``. SIGTERM or Ctrl-C removes every fault inside it, then stops it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from streamquake.errors import ScenarioError, StreamquakeError
from streamquake.faults.proxy.wire import CONTROL_PREFIX
from streamquake.journal import owner_alive, pid_start_time, state_dir
from streamquake.loopback import is_loopback
from streamquake.units import parse_duration_s


def control_url_for(text: str) -> str:
    """A standing proxy as a person names it (``HOST:PORT``, its URL ``http://HOST:PORT``, or its
    control URL) -> its control URL. Raises ValueError with a sentence."""
    raw = text.strip().rstrip("/")
    parts = urlsplit(raw if "://" in raw else f"http://{raw}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme != "http" or not parts.hostname or port is None or parts.username
            or parts.query or parts.fragment or parts.path not in ("", CONTROL_PREFIX)):
        raise ValueError(f"{text!r} does not name a standing SSE proxy: give its address "
                         f"HOST:PORT, its URL http://HOST:PORT or its control URL "
                         f"http://HOST:PORT{CONTROL_PREFIX}, as `streamquake proxy` prints them")
    return f"http://{parts.netloc}{CONTROL_PREFIX}"


def proxy_address(control_url: str) -> str:
    """``http://127.0.0.1:8081/_streamquake`` -> ``127.0.0.1:8081``."""
    return urlsplit(control_url).netloc.lower()


# --- finding the standing proxies of this host ------------------------------------------------


@dataclass(frozen=True)
class StandingProxy:
    url: str
    upstream: str
    pid: int
    pid_start: int | None

    @property
    def control_url(self) -> str:
        return self.url + CONTROL_PREFIX

    @property
    def address(self) -> str:
        return proxy_address(self.url)


def _registry() -> Path:
    return state_dir() / "proxies"


def running_proxies() -> list[StandingProxy]:
    """The standing proxies of this state directory that still run (no network)."""
    found = []
    for path in sorted(_registry().glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            proxy = StandingProxy(url=str(raw["url"]), upstream=str(raw["upstream"]),
                                  pid=int(raw["pid"]), pid_start=raw.get("pid_start"))
        except (OSError, ValueError, KeyError, TypeError):
            continue   # half written, or not ours: a proxy that cannot be read is not offered
        if owner_alive(proxy.pid, proxy.pid_start):
            found.append(proxy)
    return found


def _register(url: str, upstream: str) -> Path:
    registry = _registry()
    registry.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = registry / f"{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "upstream": upstream, "pid": os.getpid(),
                               "pid_start": pid_start_time(os.getpid())}))
    os.replace(tmp, path)
    return path


# --- serving ------------------------------------------------------------------------------------


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if (not sep or not host or not port.isascii() or not port.isdigit() or len(port) > 5
            or int(port) > 65535):
        raise ScenarioError(f"--listen {text!r}: give HOST:PORT, e.g. 127.0.0.1:8081 (port 0: "
                            "any free port)")
    return host.strip("[]"), int(port)


def serve_standing(upstream: str, listen: str, *, seed: int = 0, insecure: bool = False,
                   read_timeout: str = "120s") -> int:
    """Run a standing proxy in the foreground until SIGTERM or Ctrl-C; returns the exit code."""
    from yarl import URL

    from streamquake.faults.proxy.server import ProxyState, run_serving, serve

    host, port = _listen(listen)
    target = URL(upstream)
    if target.scheme not in ("http", "https") or not target.host:
        raise ScenarioError(f"--upstream {upstream!r}: give an http:// or https:// URL with a "
                            "host, e.g. http://127.0.0.1:8000")
    try:
        read_timeout_s = parse_duration_s(read_timeout)
    except ValueError as exc:
        raise ScenarioError(f"--read-timeout: {exc}") from None
    if read_timeout_s < 0.1:
        raise ScenarioError(f"--read-timeout {read_timeout}: every upstream pause would fail "
                            "a request; give at least 100ms, e.g. --read-timeout 120s")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="streamquake-proxy: %(levelname)s %(message)s")
    state = ProxyState(upstream=target, seed=seed, insecure=insecure, connect_timeout_s=10.0,
                       read_timeout_s=read_timeout_s)
    registered: list[Path] = []

    def announce(url: str) -> None:
        address = proxy_address(url)
        print(f"streamquake SSE proxy, pid {os.getpid()}: {url} -> {upstream}\n"
              f"control API: {url}{CONTROL_PREFIX}; faults go in under a lease, e.g. "
              f"`streamquake inject sse_proxy drop=15% --for 2m --proxy {address}`\n"
              "stop it with Ctrl-C or SIGTERM: every fault inside it is removed first",
              flush=True)
        if not is_loopback(host):
            print(f"WARNING: the control API takes faults from anyone who can reach {address}"
                  " (it has no token): keep that port off shared networks", file=sys.stderr,
                  flush=True)
        registered.append(_register(url, upstream))

    try:
        run_serving(serve(state, host, port, announce))
    except OSError as exc:
        raise StreamquakeError(f"cannot listen on {listen}: {exc.strerror or exc}") from exc
    finally:
        for path in registered:
            with contextlib.suppress(OSError):
                path.unlink()
    return 0
