"""A run without load, for the ownership tests (tests/test_fault_claims.py): applies the faults
given on the command line through the runner's own ``Ledger`` (journal, claims, revert pushed
before apply), holds them until a line arrives on stdin (or the process is killed), then
reverts them newest first, as a run does at its phase end.

    python tests/fault_holder.py '[{"type": "tbf", "rate": "1mbit"}]' '{"target_port": 80}'

Says ``APPLIED`` once every fault is in place; ``REFUSED <sentence>`` if one could not be
applied (then reverts what it applied and exits with that error's code); ``REVERTED`` at the
end. Context keys: ``target_host``, ``target_port``, ``client_netns``, ``network`` (a
scenario's ``network:``), ``proxy`` (the control URL of an SSE proxy the test started).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

from streamquake.errors import StreamquakeError
from streamquake.faults.catalog import fault_type
from streamquake.faults.contract import Resource, RunContext
from streamquake.faults.proxy.resources import FaultProxy
from streamquake.journal import Journal
from streamquake.run.events import Events
from streamquake.run.ledger import Ledger, PlannedFault
from streamquake.run.signals import Signals
from streamquake.scenario.network import NetworkConfig


def main(argv: list[str]) -> int:
    specs, raw = json.loads(argv[0]), json.loads(argv[1]) if len(argv) > 1 else {}
    resources: list[Resource] = [FaultProxy.attached(raw["proxy"])] if "proxy" in raw else []
    ctx = RunContext(raw.get("target_host", "127.0.0.1"), raw.get("target_port", 0),
                     Path(tempfile.mkdtemp(prefix="sq-holder-")),
                     client_netns=raw.get("client_netns"),
                     network=NetworkConfig(**raw["network"]) if "network" in raw else None,
                     resources=resources)
    events = Events()
    ledger = Ledger(Journal(), Signals(events), events)
    refused: StreamquakeError | None = None
    with contextlib.ExitStack() as stack:
        try:
            for spec_raw in specs:
                known = fault_type(spec_raw["type"])
                spec = known.spec.model_validate(spec_raw)
                ledger.apply(stack, PlannedFault(spec, known.injector()(spec, ctx), "fault"))
        except StreamquakeError as exc:
            refused = exc
            print("REFUSED", exc, flush=True)
        if refused is None:
            print("APPLIED", flush=True)
            sys.stdin.readline()
    print("REVERTED", json.dumps([r.error for r in ledger.records if r.error]), flush=True)
    return refused.exit_code if refused is not None else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
