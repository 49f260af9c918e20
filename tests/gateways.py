"""A real gateway for the tests: Debian's nginx in front of any upstream URL, as a plain process
of the test's own (not the system service), in a folder of its own.

``nginx(upstream, flavour, root)`` starts it on a free 127.0.0.1 port and yields a
:class:`Gateway`; it is stopped after, however the test ends. Flavours:

* ``streaming``: set up for event streams (``proxy_buffering off``, HTTP/1.1 and keep-alive
  to the upstream, no gzip): what streamquake measures through it should match a direct run.
* ``buffered``: ``proxy_buffering on`` with nginx's defaults (4 KiB buffers, HTTP/1.0 to the
  upstream: with 1.1 to a chunked upstream nginx 1.22 passed each chunk on at once), the
  upstream's ``X-Accel-Buffering: no`` ignored (the embedded target sends it; vLLM and
  llama-server do not): events arrive in bursts of a buffer's worth, a short answer whole.
* ``gzip``: streaming, plus ``gzip on; gzip_types text/event-stream``: nginx compresses the
  stream for a client that accepts gzip.

One process (``master_process off``): nothing to orphan, and it dies with the test process
(procs.spawn); what it proxies is the same code as a worker's.

``haproxy(upstream, flavour, root)`` does the same with Debian's HAProxy (2.6), in the
foreground (``-db``), with the ``defaults`` of Debian's own ``/etc/haproxy/haproxy.cfg``:

* ``default``: as Debian ships it: HAProxy holds small writes back to fill its sends, so a
  stream arrives in lumps (about a dozen events each here, the headers with the first).
* ``no-delay``: plus ``option http-no-delay``, HAProxy's switch for interactive traffic.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import pytest

from streamquake.procs import spawn, stop
from tests.conftest import free_port
from tests.timing import wait_until

Flavour = Literal["streaming", "buffered", "gzip"]
HAProxyFlavour = Literal["default", "no-delay"]
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
_BIND_TRIES = 3

_STREAMING = """
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_cache off;"""
_FLAVOURS: dict[str, str] = {
    "streaming": _STREAMING,
    "buffered": """
      proxy_buffering on;
      proxy_ignore_headers X-Accel-Buffering;
      gzip off;""",
    "gzip": _STREAMING + """
      gzip on;
      gzip_types text/event-stream;
      gzip_proxied any;""",
}

_CONF = """
daemon off;
master_process off;
pid {root}/nginx.pid;
error_log {root}/error.log info;
events {{ worker_connections 1024; }}
http {{
  access_log {root}/access.log;
  client_body_temp_path {root}/tmp/client_body;
  proxy_temp_path {root}/tmp/proxy;
  fastcgi_temp_path {root}/tmp/fastcgi;
  uwsgi_temp_path {root}/tmp/uwsgi;
  scgi_temp_path {root}/tmp/scgi;
  upstream llm {{
    server {upstream_host};{keepalive}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://llm{upstream_path};
      proxy_read_timeout 120s;{flavour}
    }}
  }}
}}
"""


@dataclass(frozen=True)
class Gateway:
    url: str            # http://127.0.0.1:<port>, to use as a scenario's target.url
    flavour: Flavour | HAProxyFlavour
    root: Path          # its prefix: nginx.conf, error.log, access.log, nginx.pid, tmp/

    @property
    def error_log(self) -> str:
        path = self.root / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Wait until nginx accepts on ``port``; False if it exited first."""
    wait_until(lambda: proc.poll() is not None or _accepts(port), "nginx to listen")
    return proc.poll() is None


@contextmanager
def nginx(upstream: str, flavour: Flavour, root: Path,
          upstream_keepalive: bool = True) -> Iterator[Gateway]:
    """nginx on a free loopback port, proxying everything to ``upstream`` (an http:// URL; its
    path, if any, prefixes every request's), configured as ``flavour``; stopped after.
    ``upstream_keepalive=False``: no pool of idle upstream connections (``keepalive 16`` left
    out), as for an upstream that closes each connection after a streamed answer without
    saying so: llama-server says ``Keep-Alive: timeout=5, max=100`` and closes 25-40 ms after
    the stream's last chunk (measured here), so a pool hands the next request a closing
    connection now and then, and nginx answers that POST 502 without retrying it."""
    if not Path(NGINX).exists():     # fail, never skip: the suite's rule for what it needs
        pytest.fail("nginx is not installed: scripts/setup --tests installs Debian's package")
    parts = urlsplit(upstream)
    assert parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost"), upstream
    (root / "tmp").mkdir(parents=True, exist_ok=True)
    for _ in range(_BIND_TRIES):
        port = free_port()     # free a moment ago: another process may take it (retried)
        conf = root / "nginx.conf"
        conf.write_text(_CONF.format(
            root=root, port=port, upstream_host=parts.netloc,
            upstream_path=parts.path.rstrip("/"), flavour=_FLAVOURS[flavour],
            keepalive="\n    keepalive 16;" if upstream_keepalive else ""))
        proc = spawn([NGINX, "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if _listening(proc, port):
                yield Gateway(f"http://127.0.0.1:{port}", flavour, root)
                return
        finally:
            stop(proc)
        log = (root / "error.log").read_text(errors="replace")
        if "Address already in use" not in log:
            pytest.fail(f"nginx exited with code {proc.returncode}:\n{log}")
    pytest.fail(f"nginx found no free port in {_BIND_TRIES} tries")


# Debian's defaults (/etc/haproxy/haproxy.cfg of the haproxy package), less logging.
_HAPROXY_CONF = """
global
  maxconn 1024
defaults
  mode http
  option dontlognull
  timeout connect 5000
  timeout client 50000
  timeout server 50000{flavour}
frontend llm
  bind 127.0.0.1:{port}
  default_backend upstream
backend upstream
  server up {upstream_host}
"""
_HAPROXY_FLAVOURS: dict[str, str] = {"default": "", "no-delay": "\n  option http-no-delay"}


@contextmanager
def haproxy(upstream: str, flavour: HAProxyFlavour, root: Path) -> Iterator[Gateway]:
    """HAProxy on a free loopback port in front of ``upstream`` (an http:// URL with no path),
    configured as ``flavour``; stopped after."""
    if not Path(HAPROXY).exists():     # fail, never skip
        pytest.fail("haproxy is not installed: scripts/setup --tests installs Debian's package")
    parts = urlsplit(upstream)
    assert parts.scheme == "http" and parts.path in ("", "/"), upstream
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(_BIND_TRIES):
        port = free_port()     # free a moment ago: another process may take it (retried)
        conf = root / "haproxy.cfg"
        conf.write_text(_HAPROXY_CONF.format(port=port, upstream_host=parts.netloc,
                                             flavour=_HAPROXY_FLAVOURS[flavour]))
        log = root / "haproxy.log"
        with open(log, "wb") as out:
            proc = spawn([HAPROXY, "-db", "-f", str(conf)], stdout=out,
                         stderr=subprocess.STDOUT)
        try:
            if _listening(proc, port):
                yield Gateway(f"http://127.0.0.1:{port}", flavour, root)
                return
        finally:
            stop(proc)
        said = log.read_text(errors="replace")
        if "Address already in use" not in said and "cannot bind" not in said:
            pytest.fail(f"haproxy exited with code {proc.returncode}:\n{said}")
    pytest.fail(f"haproxy found no free port in {_BIND_TRIES} tries")
