"""engine: faults in the serving engine itself. ``cache_flush`` erases its KV (prefix) cache
through llama-server's slots API, once or on a period inside the fault's window;
``noisy_tenant`` loads it with another tenant's long streams for the window.

Private machinery: ``slots`` (the slots API over HTTP, errors as sentences), ``flush`` (the
injector and its per-slot threads), ``streams`` (one tenant stream, sent and counted) and
``tenant`` (the noisy tenant's injector, its threads, and the scenario's target as it asks it).
"""

from __future__ import annotations

from collections.abc import Sequence

from streamquake.faults.contract import (
    Family,
    FaultType,
    InjectorFactory,
    Resource,
    ScenarioView,
)
from streamquake.faults.engine.spec import CacheFlushFault, NoisyTenantFault


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


def _tenant() -> InjectorFactory[NoisyTenantFault]:
    from streamquake.faults.engine.tenant import NoisyTenantInjector

    return NoisyTenantInjector


def _tenant_where(spec: NoisyTenantFault, scenario: ScenarioView) -> str:
    target = spec.url or "the target (straight, not through the run's proxy)"
    how = (f"{spec.rate_per_s:g} new requests a second, at most {spec.concurrency} open"
           if spec.rate_per_s is not None else f"{spec.concurrency} streams open at once")
    fmt = spec.protocol or scenario.target.protocol
    return (f"{target}: another tenant's {fmt} streams ({how}; prompts of "
            f"{spec.prompt_tokens} words, answers of up to {spec.max_tokens} tokens), not "
            "counted among the scenario's samples; revert closes them")


def _tenant_needs_target(spec: NoisyTenantFault) -> str | None:
    if spec.url is not None:
        return None
    return ("noisy_tenant sends its streams to the target's address: give it as --target "
            "HOST:PORT, or the fault's url=http://HOST:PORT")


def _resources(scenario: ScenarioView) -> Sequence[Resource]:
    if not any(f.type == "noisy_tenant" for f in scenario.faults):
        return ()
    from streamquake.faults.engine.tenant import resources

    return resources(scenario)


FAMILY = Family(
    name="engine",
    faults=(FaultType[CacheFlushFault]("cache_flush", CacheFlushFault, _injector,
                                       "erase the engine's KV/prefix cache (llama-server "
                                       "slots API), once or every period", _where,
                                       _needs_target),
            FaultType[NoisyTenantFault]("noisy_tenant", NoisyTenantFault, _tenant,
                                        "another tenant's long streams (long prompts, long "
                                        "answers) against the target for the window",
                                        _tenant_where, _tenant_needs_target)),
    resources=_resources,
)
