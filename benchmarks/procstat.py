"""What a process costs, read from /proc: CPU seconds and run-queue wait, for the benchmarks
that time a client and a target side by side (``truth.py``, ``streams_sweep.py``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """user + system CPU seconds of a live process (all its threads, dead ones included)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def run_delay_s(pid: int) -> float:
    """Seconds the live threads of ``pid`` were runnable but waiting for a CPU (schedstat): how
    much other work on the same core held this process back."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9
