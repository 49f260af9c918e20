"""How long a tc fault takes to apply (kernel read-back included) and revert, vs a bare tc call.

    .venv/bin/python benchmarks/tc_apply_revert.py [--cycles 20] [--budget-s 40]
    scripts/uml-run -- .venv/bin/python benchmarks/tc_apply_revert.py     # with netem

Needs root. Everything happens in two network namespaces made here: a "client" namespace (the
load generator's side) and a target namespace behind a veth pair (NamespaceTopology); the
host's own interfaces are never touched, and the journal lives in a temporary
STREAMQUAKE_STATE_DIR. The target is reached as a remote host from the client namespace, so
``direction: both`` shapes its answers through an ingress filter and an ifb device.

Per cycle, what the runner pays at a phase edge: apply = ``journal.add`` + ``injector.apply``
(journal saves with fsync, htb root and classes, the leaf qdisc, u32 filters, the kernel
read-back and its check); revert = ``injector.revert`` (removal, then a check that nothing is
left) + ``entry.done()``. Each fault twice: on the run's scaffold (built once, as a run does
when it starts: only the leaf changes) and building its own tree (as ``inject`` and an agent
do). Baseline, in the same rounds: a bare pyroute2 ``tc add``/``tc del`` of one tbf root qdisc
on the client namespace's ``lo`` (the veth holds the scaffold), through an already open netlink
socket (the floor any tool pays). Cases and baseline take turns in every round so that CPU
contention hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyroute2 import netns as pr_netns  # noqa: E402
from pyroute2.netlink.rtnl import TC_H_ROOT  # noqa: E402

from streamquake.faults.contract import RunContext, Wiring  # noqa: E402
from streamquake.faults.tc.netem import NetemFault, NetemInjector  # noqa: E402
from streamquake.faults.tc.netns import NamespaceTopology, iproute  # noqa: E402
from streamquake.faults.tc.probe import kernel_features  # noqa: E402
from streamquake.faults.tc.resources import TcScaffold  # noqa: E402
from streamquake.faults.tc.tbf import TbfFault, TbfInjector  # noqa: E402
from streamquake.journal import Journal  # noqa: E402
from streamquake.scenario.network import NetworkConfig  # noqa: E402

UML_COMMAND = "scripts/uml-run -- .venv/bin/python benchmarks/tc_apply_revert.py"
TARGET_PORT = 8080  # nothing listens: the filters match on it, no packet is needed
TBF = {"type": "tbf", "rate": "8mbit", "burst": "10kb", "latency": "50ms"}
NETEM = {"type": "netem", "delay": "100ms", "jitter": "30ms"}  # cross-region-jitter.yaml's
BASE_HANDLE = 0x10000  # 1:


@dataclass
class Timings:
    apply_ms: list[float] = field(default_factory=list)
    revert_ms: list[float] = field(default_factory=list)
    # Where apply's time goes (ours only): journal.add, install (with its journal saves).
    journal_ms: list[float] = field(default_factory=list)
    install_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], Any]  # a fresh injector
    via_ifb: list[bool]  # the hops apply must have planned; else this is not the case named
    leaf_only: bool  # on the run's scaffold (only the leaf changes), or its own tree


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def p90(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


# --- the namespaces ---------------------------------------------------------------------------


@contextlib.contextmanager
def client_namespace() -> Iterator[str]:
    name = f"sqbench-{uuid.uuid4().hex[:8]}"
    pr_netns.create(name)
    try:
        with iproute(name) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        yield name
    finally:
        pr_netns.remove(name)


# --- one cycle each -------------------------------------------------------------------------


def ours_cycle(case: Case, journal: Journal, out: Timings) -> dict[str, Any]:
    inj = case.make()
    t0 = time.perf_counter()
    entry = journal.add(inj.type_name, case.name)
    t1 = time.perf_counter()
    try:
        result = inj.apply(entry)
        t2 = time.perf_counter()
    finally:
        t3 = time.perf_counter()
        inj.revert()  # also after a failed apply: idempotent, never leaves a fault behind
        entry.done()
        t4 = time.perf_counter()
    out.apply_ms.append((t2 - t0) * 1000)
    out.revert_ms.append((t4 - t3) * 1000)
    out.journal_ms.append((t1 - t0) * 1000)
    out.install_ms.append(float(result["apply_ms"]))
    return result  # type: ignore[no-any-return]


def baseline_cycle(ipr: Any, index: int, spec: TbfFault, out: Timings) -> None:
    t0 = time.perf_counter()
    ipr.tc("add", "tbf", index=index, handle=BASE_HANDLE, parent=TC_H_ROOT,
           rate=round(spec.rate_bytes_per_s), burst=spec.burst,
           latency=round(spec.latency_ms * 1000))
    t1 = time.perf_counter()
    ipr.tc("del", None, index, BASE_HANDLE, parent=TC_H_ROOT)
    t2 = time.perf_counter()
    out.apply_ms.append((t1 - t0) * 1000)
    out.revert_ms.append((t2 - t1) * 1000)


# --- the run --------------------------------------------------------------------------------


def cases_for(run_ctx: RunContext, bare_ctx: RunContext, netem: bool) -> list[Case]:
    """Each fault on the run's scaffold (``run_ctx``), then building its own tree as `inject`
    and an agent do (``bare_ctx``, no scaffold)."""
    def make(cls: Any, model: Any, fields: dict[str, str], direction: str,
             ctx: RunContext) -> Callable[[], Any]:
        spec = model.model_validate({**fields, "direction": direction})
        return lambda: cls(spec, ctx)

    kinds = [("tbf", TbfInjector, TbfFault, TBF)]
    if netem:
        kinds.append(("netem", NetemInjector, NetemFault, NETEM))
    cases = []
    for ctx, own in ((run_ctx, ""), (bare_ctx, ", own tree")):
        for name, cls, model, fields in kinds:
            cases += [Case(f"{name} egress{own}", make(cls, model, fields, "egress", ctx),
                           [False], not own),
                      Case(f"{name} both (ifb){own}", make(cls, model, fields, "both", ctx),
                           [False, True], not own)]
    return cases


def scaffold_for(ctx: RunContext) -> TcScaffold:
    """What a run whose tc faults shape egress and both directions builds when it starts."""
    scaffold = TcScaffold([TbfFault.model_validate({**TBF, "direction": d})
                           for d in ("egress", "both")])
    scaffold.start(ctx, Wiring(target_netns=ctx.target_netns))
    if scaffold.scaffold is None:
        raise RuntimeError(f"the scaffold was not built: {scaffold.problem}")
    ctx.resources.append(scaffold)
    return scaffold


def run(cycles: int, budget_s: float, state_dir: Path, have: frozenset[str], made: list[str]
        ) -> tuple[Timings, dict[str, Timings], int, float, float]:
    """``made`` collects the namespaces created, so the caller can check they are gone."""
    journal = Journal(state_dir / "journal.json")
    with client_namespace() as client_ns, \
            NamespaceTopology(host_netns=client_ns, journal=journal) as topo:
        made += [client_ns, topo.netns]
        def ctx() -> RunContext:
            return RunContext(topo.target_addr, TARGET_PORT, state_dir, client_netns=client_ns,
                              network=NetworkConfig(mode="host"), journal=journal)

        run_ctx = ctx()
        scaffold = scaffold_for(run_ctx)
        cases = cases_for(run_ctx, ctx(), "netem" in have)
        base_spec = TbfFault.model_validate(TBF)
        base = Timings()
        ours = {c.name: Timings() for c in cases}
        with iproute(client_ns) as ipr:
            veth = ipr.link_lookup(ifname="lo")[0]   # the veth holds the run's scaffold
            # One untimed round: first-use costs (module autoload, imports) are not the figure.
            baseline_cycle(ipr, veth, base_spec, Timings())
            for c in cases:
                hops = ours_cycle(c, journal, Timings())["hops"]
                if ([bool(h.get("via_ifb")) for h in hops] != c.via_ifb
                        or any(bool(h.get("leaf_only")) != c.leaf_only for h in hops)):
                    raise RuntimeError(f"{c.name}: apply shaped {hops}, not the hops this case "
                                       "is meant to measure")
            started = time.perf_counter()
            done = 0
            while done < cycles and time.perf_counter() - started < budget_s:
                baseline_cycle(ipr, veth, base_spec, base)
                for c in cases:
                    ours_cycle(c, journal, ours[c.name])
                done += 1
            elapsed = time.perf_counter() - started
        scaffold.stop()
        left = journal.entries()
        if [e for e in left if e["type"] != "netns"]:
            raise RuntimeError(f"faults left in the benchmark's journal: {left}")
    assert scaffold.scaffold is not None
    return base, ours, done, elapsed, scaffold.scaffold.build_ms or 0.0


def report(base: Timings, ours: dict[str, Timings], done: int, elapsed: float,
           have: frozenset[str], build_ms: float) -> None:
    uml = " (User-Mode Linux)" if os.environ.get("STREAMQUAKE_UML") else ""
    print(f"kernel {platform.release()}{uml}; {done} cycles per row in {elapsed:.1f} s, "
          f"cases and baseline interleaved; load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    print(f"the run's scaffold (htb, classes, filters, ifb; built once): {build_ms:.1f} ms")
    print("apply = journal.add + injector.apply (read-back and check included); "
          "revert = injector.revert (leftover check included) + entry.done")
    print("baseline = bare pyroute2 tc add / tc del of one tbf root qdisc on the client "
          "namespace's lo, open socket")
    hdr = (f"{'case':<28} {'apply p50':>9} {'p90':>7} {'x base':>6} {'x p90':>6} "
           f"{'revert p50':>10} {'p90':>7} {'x base':>6} {'x p90':>6}")
    print(hdr)
    print("-" * len(hdr))
    ba50, ba90, br50, br90 = (median(base.apply_ms), p90(base.apply_ms),
                              median(base.revert_ms), p90(base.revert_ms))
    print(f"{'baseline tbf root':<28} {ba50:>9.2f} {ba90:>7.2f} {'1.0':>6} {'1.0':>6} "
          f"{br50:>10.2f} {br90:>7.2f} {'1.0':>6} {'1.0':>6}")
    for name, t in ours.items():
        a50, a90, r50, r90 = (median(t.apply_ms), p90(t.apply_ms),
                              median(t.revert_ms), p90(t.revert_ms))
        print(f"{name:<28} {a50:>9.2f} {a90:>7.2f} {a50 / ba50:>6.1f} {a90 / ba90:>6.1f} "
              f"{r50:>10.2f} {r90:>7.2f} {r50 / br50:>6.1f} {r90 / br90:>6.1f}")
    print("(ms; x base = ours / baseline at the same percentile)")
    print(f"\nwhere apply's time goes, median ms: {'journal.add':>11} {'install':>8} "
          f"{'read-back+check':>15}")
    for name, t in ours.items():
        j, i, a = median(t.journal_ms), median(t.install_ms), median(t.apply_ms)
        print(f"  {name:<33} {j:>11.2f} {i:>8.2f} {a - j - i:>15.2f}")
    if "netem" not in have:
        print(f"\nnetem: not measured: this kernel ({platform.release()}) has no netem qdisc "
              f"(CONFIG_NET_SCH_NETEM). Run it inside User-Mode Linux:\n  {UML_COMMAND}")


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally below


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cycles", type=int, default=20, help="apply+revert cycles per case")
    p.add_argument("--budget-s", type=float, default=40.0,
                   help="stop timed rounds after this long (the run stays under a minute)")
    args = p.parse_args()
    if args.cycles < 1:
        p.error("--cycles must be at least 1")
    if os.geteuid() != 0:
        print("tc_apply_revert: needs root (network namespaces and qdiscs)", file=sys.stderr)
        return 3
    signal.signal(signal.SIGTERM, _sigterm)
    state_dir = Path(tempfile.mkdtemp(prefix="sqbench-state-"))
    # Anything that builds a default Journal lands here, never in the real journal.
    os.environ["STREAMQUAKE_STATE_DIR"] = str(state_dir)
    made: list[str] = []
    try:
        have = kernel_features()
        base, ours, done, elapsed, build_ms = run(args.cycles, args.budget_s, state_dir, have,
                                                  made)
    finally:
        stale = [n for n in made if n in pr_netns.listnetns()]
        shutil.rmtree(state_dir, ignore_errors=True)
        if stale:
            print(f"tc_apply_revert: namespaces left behind: {stale}", file=sys.stderr)
    report(base, ours, done, elapsed, have, build_ms)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("tc_apply_revert: interrupted", file=sys.stderr)
        sys.exit(130)
