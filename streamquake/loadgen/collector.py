"""When the garbage collector may stop a load process's hub: young collections often and
small, full ones only when memory asks for one.

A full collection walks every object the collector tracks, with the hub held: about 0.1 ms of
CPU per open stream by default, far past the saturation guard's 50 ms at a few thousand
streams, wherever it falls (benchmarks/README.md, "garbage collection"). A stream's own objects
form no cycles (its client, parser and sample are freed by their reference counts), so a load
process makes almost no garbage that only a full collection can free. So, in a load process
that runs users (:func:`start`, from the locustfile):

* the oldest generation's threshold is raised out of reach: the interpreter never starts a full
  collection by itself;
* generations 0 and 1 are collected every :data:`YOUNG_S` as well as by the interpreter's own
  thresholds, so cycles that die young are still freed at once. By the thresholds alone a young
  collection can wait seconds: they count allocations net of deallocations, and each ended
  stream's freed objects cancel the new ones', while the young generation fills with every
  object made since (each waiting read's, each new request's): about 100 ms of CPU at 2,500
  streams. Every :data:`YOUNG_S` it holds only what that stretch made and kept (12 ms). The
  price: every object that outlives YOUNG_S is walked once (a waiting read's do), so the
  collector takes more CPU in all (8% of the load process's at 2,500 streams, from 2%);
  collecting every 0.1 or 0.2 s took more CPU still, and longer;
* each time Locust has spawned the users (``spawning_complete``), the young generations are
  collected and every object alive is frozen (``gc.freeze``: modules, Locust, the users and
  their clients), so that a later full collection walks only what came after; the memory the
  users took counts from then on;
* once a second, should the process's RSS have grown by :data:`GROWTH_SHARE` (and at least
  :data:`GROWTH_MIN_MB`) since the last full collection, one runs at once, over everything (the
  frozen objects are thawed first, so no cycle is kept for good): memory stays bounded, and the
  pause is measured like any other collection (``holds.py``, kind ``gc_full``).

**Opt-in, for now** (``STREAMQUAKE_GC=steady`` in the load process's environment): in the
suite's User-Mode Linux runs (one slow CPU for the target, the proxy, Locust and the runner) a
load process under this policy sent its first request 20 s late and its hub lagged 1.3 s at
p99, where the interpreter's own policy passed; until that is understood a load process keeps
the interpreter's thresholds and reports every collection's pause (``holds.py``) either way.
``benchmarks/concurrency.py --gc`` A/Bs both in the product path.
"""

from __future__ import annotations

import gc
import itertools
import os
from typing import Any

YOUNG_S = 0.05
CHECK_S = 1.0
GROWTH_SHARE = 0.25
GROWTH_MIN_MB = 32.0
_OUT_OF_REACH = 2**31 - 1       # gen-2 threshold: gen-1 collections between full ones
GC_ENV = "STREAMQUAKE_GC"
STEADY = "steady"

_saved: tuple[int, int, int] | None = None
_greenlet: Any = None
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
_rss_base_mb = 0.0


def rss_mb() -> float:
    """This process's resident memory now, MB (Linux: one read of ``/proc/self/statm``)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE_MB


def collect_full() -> int:
    """One full collection over every object, frozen ones too; then freeze what is left."""
    global _rss_base_mb
    gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    _rss_base_mb = rss_mb()
    return found


def settle() -> None:
    """The users are spawned: freeze what is alive, so no full collection walks it again; the
    memory they took is no reason for one."""
    global _rss_base_mb
    gc.collect(1)
    gc.freeze()
    _rss_base_mb = rss_mb()


def due() -> bool:
    """Has memory grown enough since the last full collection to need another?"""
    grown = rss_mb() - _rss_base_mb
    return grown >= max(GROWTH_MIN_MB, GROWTH_SHARE * _rss_base_mb)


def _collect() -> None:
    import gevent

    ticks_per_check = round(CHECK_S / YOUNG_S)
    for tick in itertools.count(1):
        gevent.sleep(YOUNG_S)
        if tick % ticks_per_check == 0 and due():
            collect_full()
        else:
            gc.collect(1)


def start(runner: object, force: bool = False) -> None:
    """Defer full collections in this load process (not a Locust master: it runs no users),
    when ``STREAMQUAKE_GC=steady`` asks for it (or ``force``: the tests and benchmarks)."""
    global _saved, _greenlet, _rss_base_mb
    import gevent

    if _saved is not None or not (force or os.environ.get(GC_ENV) == STEADY):
        return
    if runner is not None:
        from locust.runners import MasterRunner

        if isinstance(runner, MasterRunner):
            return
        runner.environment.events.spawning_complete.add_listener(  # type: ignore[attr-defined]
            lambda **_: settle())
    _saved = gc.get_threshold()
    gc.set_threshold(_saved[0], _saved[1], _OUT_OF_REACH)
    _rss_base_mb = rss_mb()
    _greenlet = gevent.spawn(_collect)


def stop() -> None:
    """The interpreter's own thresholds again, nothing frozen (the tests run several)."""
    global _saved, _greenlet
    if _greenlet is not None:
        _greenlet.kill()
    if _saved is not None:
        gc.set_threshold(*_saved)
        gc.unfreeze()
    _saved = _greenlet = None
