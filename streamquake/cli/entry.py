"""The console script: every command's errors end here, and output outlives its reader."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from typing import Any

import typer

from streamquake.cli.base import (
    app,
    fail,
)
from streamquake.errors import StreamquakeError
from streamquake.journal import state_dir


class _ReaderGone:
    """stdout or stderr that outlives its reader: ``run ... | tee log`` and Ctrl-C stops tee
    with the run (one process group), and the run's next line then raised BrokenPipeError, so
    an interrupted run wrote no report and exited 1. Once the reader is gone, the command goes
    on, and what this stream would show goes to ``KEPT_OUTPUT`` in the state directory (its
    descriptor points there; /dev/null where that cannot be opened): the end of a run whose
    reader left, an error included, can still be read."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _lost(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            kept = _kept_output()
            os.dup2(kept, self._stream.fileno())    # a later flush of its buffer lands here
            os.close(kept)

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._lost()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


KEPT_OUTPUT = "output-after-its-reader-left.log"


def _kept_output() -> int:
    """A descriptor appending to ``KEPT_OUTPUT`` (headed by this process and the time), or to
    /dev/null where the state directory cannot take it."""
    try:
        directory = state_dir()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / KEPT_OUTPUT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return os.open(os.devnull, os.O_WRONLY)
    os.write(fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                 f"{' '.join(sys.argv[1:3])}: the reader of its output went away; what it "
                 "showed after that follows\n".encode())
    return fd


def main() -> None:
    # Arguments that are not UTF-8 arrive as surrogates (PEP 383); echoing one must not end
    # the command in a traceback.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    sys.stdout = _ReaderGone(sys.stdout)
    sys.stderr = _ReaderGone(sys.stderr)
    try:
        app()
    except StreamquakeError as exc:
        # Every command's errors end here: "Error: <sentence>" and the error's own exit code
        # (the traceback only under --debug).
        try:
            fail(exc)
        except typer.Exit as done:
            sys.exit(done.exit_code)
