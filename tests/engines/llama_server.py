"""llama.cpp's ``llama-server`` on loopback, serving the tiny model of ``tests.engines.model``.

The binary is ``$STREAMQUAKE_LLAMA_SERVER`` when set, else the one ``scripts/build-llama-server``
built into its cache (``scripts/setup --tests`` builds it once per machine). A missing binary
fails the tests that need it, with the command that builds it: CI always builds it first.
"""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamquake.procs import spawn, stop
from tests.conftest import free_port
from tests.engines.model import SPECIAL_IDS, write_model
from tests.timing import HANG_S, wait_until

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "build-llama-server"
ENV_BINARY = "STREAMQUAKE_LLAMA_SERVER"
ALIAS = "tiny-llama"
# Every stream has exactly max_tokens tokens: no end of generation, no special token sampled.
EXACT_LENGTH = {"ignore_eos": True, "logit_bias": {str(t): -100 for t in SPECIAL_IDS}}


@dataclass(frozen=True)
class LlamaServer:
    url: str                          # http://127.0.0.1:PORT
    alias: str
    log: Path                         # the server's own output, for a failing test to show

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def binary() -> Path:
    """The llama-server binary; fails the test (never skips) when there is none."""
    given = os.environ.get(ENV_BINARY)
    if given:
        if not os.access(given, os.X_OK):
            pytest.fail(f"${ENV_BINARY}={given} is not an executable file")
        return Path(given)
    done = subprocess.run([str(BUILD), "--cached"], capture_output=True, text=True,
                          timeout=HANG_S)
    if done.returncode != 0:
        pytest.fail(f"no llama-server binary: {done.stderr.strip()} Build it once per machine "
                    f"with scripts/build-llama-server (scripts/setup --tests does; 6 to 18 "
                    f"minutes on 2 cores), or set ${ENV_BINARY} to one.")
    return Path(done.stdout.strip().splitlines()[-1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False         # not listening yet, or 503 while the model loads


def serve(workdir: Path, slots: int = 4, threads: int = 1, extra: tuple[str, ...] = (),
          model_file: Path | None = None, alias: str = ALIAS) -> Iterator[LlamaServer]:
    """Start llama-server on a free loopback port with the tiny model (or ``model_file``, served
    as ``alias``; ``extra``: more of its options); yield it once /health answers, and stop it
    after, whatever happened."""
    exe = binary()
    model = model_file or write_model(workdir / "tiny-llama.gguf")
    port = free_port()
    log = workdir / "llama-server.log"
    cmd = [str(exe), "-m", str(model), "-a", alias, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(1024 * slots),
           "--no-webui", "--no-warmup", *extra]
    with open(log, "wb") as out:
        proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = LlamaServer(f"http://127.0.0.1:{port}", alias, log)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n{server.log_tail()}")
            return _healthy(server.url)
        wait_until(ready, "llama-server to answer /health", interval_s=0.1)
        yield server
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    yield from serve(tmp_path_factory.mktemp("llama-server"))
