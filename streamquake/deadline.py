"""Waiting on something that may never answer (a netlink call stuck on the rtnl lock, a hung
NVML call) without hanging the run: the work goes to a daemon thread, the caller stops waiting."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a worker thread and give up waiting after ``timeout_s``.

    Netlink calls wait on the kernel's rtnl lock; a stuck one must not hang a revert forever.
    """
    value: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            value.append(fn())
        except BaseException as exc:  # handed to the caller's thread below
            error.append(exc)

    worker = threading.Thread(target=work, name=f"streamquake {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")
    if error:
        raise error[0]
    return value[0]
