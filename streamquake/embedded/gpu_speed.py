"""How much slower GPU 0 runs than it could: the embedded target's link to real GPU faults.

With ``gpu_clock_scale: true`` the target multiplies its simulated TTFT and inter-token delays by
``slowdown_factor()``, so a clock lock applied through NVML (real or emulated) shows up end to
end as slower tokens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

_CACHE_S = 0.2

_lock = threading.Lock()


@dataclass
class _Gpu0:
    factor: float = 1.0
    read_at: float | None = None
    handle: object = None       # pynvml's handle of GPU 0, once NVML is open
    max_mhz: int = 0
    absent: bool = False        # no NVML here: that will not change while we run


_state = _Gpu0()


def slowdown_factor() -> float:
    """max SM clock / current SM clock of GPU 0 (>= 1.0); 1.0 when NVML is absent.

    Read through NVML at most every 200 ms; callers may call it per token.
    """
    with _lock:
        now = time.monotonic()
        read_at = _state.read_at
        if read_at is not None and now - read_at < _CACHE_S:
            return _state.factor
        _state.factor = _read_factor()
        _state.read_at = now
        return _state.factor


def _read_factor() -> float:
    if _state.absent:
        return 1.0
    if _state.handle is None and not _open():
        return 1.0
    import pynvml

    try:
        current = int(pynvml.nvmlDeviceGetClockInfo(_state.handle, pynvml.NVML_CLOCK_SM))
    except pynvml.NVMLError:
        return 1.0  # a GPU that cannot answer is not evidence of a slowdown
    if current <= 0:
        return 1.0
    return max(1.0, _state.max_mhz / current)


def _open() -> bool:
    """Initialise NVML once for the life of the process; remember when it is not there."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        # No driver library or no kernel driver: that will not change while we run.
        _state.absent = True
        return False
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        max_mhz = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except pynvml.NVMLError:
        pynvml.nvmlShutdown()
        return False  # e.g. GPU 0 lost: try again on the next read
    if max_mhz <= 0:
        pynvml.nvmlShutdown()
        return False
    _state.handle, _state.max_mhz = handle, max_mhz
    return True

