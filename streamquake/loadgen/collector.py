"""When the garbage collector may stop a load process's hub: young collections often and
small, full ones only when memory asks for one.

**By default** a load process that runs users (:func:`start`) only raises the youngest
generation's threshold to :data:`YOUNG_ALLOCATIONS` (the interpreter's is 700). The threshold
counts tracked objects made net of those freed, and a stream's objects are freed when it ends,
so at 700 a young collection came every ~0.1 s of 500 streams and walked the objects of every
stream begun since (requests, responses, parsers, timers: 1,000 to 7,000), each stream's
objects twice before they died or reached the oldest generation, where full collections walk
them again (65 ms each, every ~13 s). At 3,000 most of those objects die unwalked: with 100
request classes the collections held the hub about 6 ms a second instead of 15-20 (full ones
included), the longest young one no longer (13 ms); at 10,000 the total was the same, the
longest 46-57 ms (``benchmarks/truth.py --streams 500``, benchmarks/README.md).
Cycles are still collected, a few thousand objects later.

Generation 1's threshold comes down with it (:func:`middle_threshold`: 2 young collections
between two of generation 1's, not 10). A generation-1 collection walks every survivor of the
young collections since the last one: the load process's own long-lived bookkeeping (each
second's histograms per class, Locust's per-second response-time caches), 1,400 objects a young
collection at 40 users with 100 classes. Ten young collections of 3,000 made that 14,000-30,000
objects, 7-9.5 ms of CPU on a quiet core and 11.5-14 ms on a busy one (``tests/test_hub_holds.py``
failed on it in CI), where the interpreter's 700 x 10 walked a quarter as many; at 3,000 x 2,
2.7-4.2 ms. Each survivor is walked once in generation 1 either way, so the total is the same;
only the longest hold shrinks.

A full collection walks every object the collector tracks, with the hub held: about 0.1 ms of
CPU per open stream by default, far past the saturation guard's 50 ms at a few thousand
streams, wherever it falls (benchmarks/README.md, "garbage collection"). A stream's own objects
form no cycles (its client, parser and sample are freed by their reference counts), so a load
process makes almost no garbage that only a full collection can free. So, under the steady
policy (below), in a load process that runs users (:func:`start`, from the locustfile):

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

**The steady policy is opt-in, for now** (``STREAMQUAKE_GC=steady`` in the load process's
environment): in the suite's User-Mode Linux runs (one slow CPU for the target, the proxy,
Locust and the runner) a load process under it sent its first request 20 s late and its hub
lagged 1.3 s at p99, where the interpreter's own policy passed; until that is understood a
load process keeps the default above and reports every collection's pause (``holds.py``)
either way.
``benchmarks/concurrency.py --gc`` A/Bs both in the product path.
"""

from __future__ import annotations

import gc
import itertools
import os
from typing import Any

YOUNG_ALLOCATIONS = 3000       # the youngest generation's threshold, by default
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


def middle_threshold(saved: tuple[int, int, int], young: int) -> int:
    """Generation 1's threshold (young collections between two of generation 1's) once the
    youngest's is ``young``: a generation-1 collection then walks about as many objects as
    under the interpreter's own thresholds (``saved``), not ``young / saved[0]`` times as
    many (the module's "By default")."""
    return max(1, saved[0] * saved[1] // young)


def start(runner: object, force: bool = False) -> None:
    """This load process's collection policy (not a Locust master's: it runs no users): the
    youngest generation's threshold raised (the module's "By default"), or, when
    ``STREAMQUAKE_GC=steady`` asks for it (or ``force``: the tests and benchmarks), full
    collections deferred."""
    global _saved, _greenlet, _rss_base_mb
    import gevent

    if _saved is not None:
        return
    if runner is not None:
        from locust.runners import MasterRunner

        if isinstance(runner, MasterRunner):
            return
    _saved = gc.get_threshold()
    if not (force or os.environ.get(GC_ENV) == STEADY):
        young = max(_saved[0], YOUNG_ALLOCATIONS)
        gc.set_threshold(young, middle_threshold(_saved, young), _saved[2])
        return
    if runner is not None:
        runner.environment.events.spawning_complete.add_listener(  # type: ignore[attr-defined]
            lambda **_: settle())
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
