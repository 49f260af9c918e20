"""The emulated NVIDIA driver for tests: build it, describe the fake GPUs, run code against it.

The shim (tests/nvml_shim_src/fake_nvml.c) is compiled once per test session into a
temp dir as ``libnvidia-ml.so.1`` with that SONAME. pynvml finds it through LD_LIBRARY_PATH, which
the dynamic loader reads only when a process starts, so code under test always runs in a child
process started with ``FakeGpus.env()``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import streamquake

SHIM_SOURCE = Path(__file__).resolve().parent / "nvml_shim_src" / "fake_nvml.c"
REPO = Path(streamquake.__file__).resolve().parent.parent

# Run first in every child that may change GPU settings: refuse to touch a real driver.
GUARD = (
    "import pynvml as _p; _p.nvmlInit(); "
    "assert hasattr(_p.nvmlLib, 'fakeNvmlIsEmulated'), 'refusing: this is a real NVIDIA driver'; "
    "_p.nvmlShutdown()\n"
)


def build_shim(out_dir: Path) -> Path:
    """Compile the shim into ``out_dir/libnvidia-ml.so.1``; returns that path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libnvidia-ml.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror",
         "-Wl,-soname,libnvidia-ml.so.1", "-o", str(lib), str(SHIM_SOURCE)],
        check=True, capture_output=True, timeout=60,
    )
    return lib


@functools.cache
def shim_dir() -> Path:
    """A directory holding the freshly built ``libnvidia-ml.so.1`` (built once per process)."""
    out = Path(tempfile.mkdtemp(prefix="sq-fake-nvml-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    build_shim(out)
    return out


class FakeGpus:
    """The emulated driver's state file: what the GPUs are and what has been set on them."""

    def __init__(self, path: Path, **settings: Any) -> None:
        self.path = path
        defaults: dict[str, Any] = {"gpu_count": 1}
        self.write({**defaults, **settings})

    def write(self, settings: dict[str, Any]) -> None:
        """Replace the whole state. Keys like ``gpu1.lost`` go through a dict."""
        with self._locked():
            self._write_unlocked({k: str(v) for k, v in settings.items()})

    def update(self, changes: dict[str, Any]) -> None:
        """Set keys (None deletes one), as another process would see it at once."""
        with self._locked():
            state = self.read()
            for key, value in changes.items():
                if value is None:
                    state.pop(key, None)
                else:
                    state[key] = str(value)
            self._write_unlocked(state)

    def read(self) -> dict[str, str]:
        state: dict[str, str] = {}
        for line in self.path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                state[key] = value
        return state

    def text(self) -> str:
        return self.path.read_text()

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a child process that should see these GPUs."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = str(shim_dir())
        env["FAKE_NVML_STATE"] = str(self.path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env.update(extra)
        return env

    @contextlib.contextmanager
    def _locked(self) -> Any:
        # The same lock file the shim's setters take, so neither side loses the other's write.
        with open(f"{self.path}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _write_unlocked(self, state: dict[str, str]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp-py")
        tmp.write_text("".join(f"{k}={v}\n" for k, v in state.items()))
        os.replace(tmp, self.path)


def run_python(
    code: str, env: dict[str, str], timeout: float = 60, guard: bool = True
) -> Any:
    """Run ``code`` in a fresh interpreter with ``env``; return the JSON of its last stdout line.

    Raises AssertionError with the child's stderr when it fails.
    """
    proc = subprocess.run(
        [sys.executable, "-c", (GUARD if guard else "") + code],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def host_has_real_nvml() -> bool:
    """True when this host's loader would find a real libnvidia-ml without our shim."""
    import ctypes.util

    return ctypes.util.find_library("nvidia-ml") is not None


if __name__ == "__main__":
    # For a manual or CI run of a GPU scenario against the emulated driver:
    #   eval "$(python tests/nvml_shim.py /tmp/fake-nvml gpu_count=2)"
    out_dir = Path(sys.argv[1]).resolve()
    build_shim(out_dir)
    settings = dict(arg.split("=", 1) for arg in sys.argv[2:])
    FakeGpus(out_dir / "state.txt", **settings)
    print(f"export LD_LIBRARY_PATH={out_dir} FAKE_NVML_STATE={out_dir / 'state.txt'}")
