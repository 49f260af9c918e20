"""engine: faults in the serving engine itself. ``cache_flush`` erases its KV (prefix) cache
through llama-server's slots API, once or on a period inside the fault's window.

Private machinery: ``slots`` (the slots API over HTTP, errors as sentences), ``flush`` (the
injector and its per-slot threads).
"""

from __future__ import annotations

from streamquake.faults.contract import Family, FaultType, InjectorFactory, ScenarioView
from streamquake.faults.engine.spec import CacheFlushFault


def _injector() -> InjectorFactory[CacheFlushFault]:
    from streamquake.faults.engine.flush import CacheFlushInjector

    return CacheFlushInjector


def _where(spec: CacheFlushFault, scenario: ScenarioView) -> str:
    engine = spec.url or "the target"
    how = (f"every {spec.every_ms:g} ms" if spec.every_ms is not None
           else "once, as the fault is applied")
    slots = "every slot" if spec.slots == "all" else "slots " + ", ".join(map(str, spec.slots))
    return (f"the KV cache of {engine} through its slots API ({slots}, {how}); a flush cannot "
            "be undone, and revert stops the flushing")


def _needs_target(spec: CacheFlushFault) -> str | None:
    if spec.url is not None:
        return None
    return ("cache_flush erases the cache of the engine at the target's address: give it as "
            "--target HOST:PORT, or the fault's url=http://HOST:PORT")


FAMILY = Family(
    name="engine",
    faults=(FaultType[CacheFlushFault]("cache_flush", CacheFlushFault, _injector,
                                       "erase the engine's KV/prefix cache (llama-server "
                                       "slots API), once or every period", _where,
                                       _needs_target),),
)
