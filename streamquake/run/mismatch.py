"""A run that measured nothing is a protocol mismatch, never a pass.

When the server answered (streams that ended as the format ends one, or events the format could
not parse) and not one event of the whole run read as generated text, the scenario's format is
not what the server speaks at that path: every timing past the first byte is missing, and an
SLO on one of them has no value because of the reader, not the service. Such checks fail with a
sentence that says which format was expected and what came instead; and a run whose SLOs need
no text (``error_rate`` alone) gets one failing check of its own, so it cannot pass unmeasured.

The run is judged as a whole: the format does not change between phases, and a fault that
strips a phase's text (a proxy dropping every chunk) leaves the other phases' text to show that
the format reads. What the events looked like comes from the phases' ``protocol`` error reasons
(each quotes the event it could not read) and, when the caller has it, the probe's look at them
(``run/probe.py``); the scorecards keep no event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from streamquake.loadgen.metrics import Stats
from streamquake.result import Check
from streamquake.run.probe import QUESTION, expected
from streamquake.scenario import Scenario

CHECK_NAME = "streams read as target.protocol"
CHECK_METRIC = "content_events"     # the added check: content events in the run (needs >= 1)
FIRST_TOKEN = "ttft_ms"             # one value per request whose stream carried text


@dataclass(frozen=True)
class Unread:
    """What the run's measured phases got where no event read as text."""

    successes: int                   # streams that ended as the format ends one, textless
    protocol_errors: int             # requests whose events the format could not parse
    usage_tokens: int                # output tokens the textless streams' usage counted
    reason: str | None               # one protocol error's reason (it quotes the event)
    phases: tuple[str, ...]          # the phases with answers


def unread(measured: Mapping[str, Stats]) -> Unread | None:
    """The run's answers that no event of read as text, or None when any request's stream
    carried text (or none was answered at all: nothing says the format is wrong)."""
    if any(s.count(FIRST_TOKEN) or s.unattributed.get(FIRST_TOKEN) for s in measured.values()):
        return None
    successes = sum(s.successes for s in measured.values())
    errors = sum(s.errors.get("protocol", 0) for s in measured.values())
    if not successes and not errors:
        return None
    reasons = [r for s in measured.values() for r in s.error_reasons.get("protocol", {})]
    return Unread(successes, errors, sum(s.usage_tokens for s in measured.values()),
                  reasons[0] if reasons else None,
                  tuple(n for n, s in measured.items() if s.successes or s.errors.get("protocol")))


def mismatch_sentence(scenario: Scenario, what: Unread, seen: str | None = None) -> str:
    """Which format was expected, and what the run got instead. ``seen``: the probe's look at
    the events (``Looked.text()``), when there was one."""
    target = scenario.target
    got = []
    if what.successes:
        usage = (f"; their usage counted {what.usage_tokens:,} output tokens, so the server "
                 "generated text that was not read" if what.usage_tokens else "")
        got.append(f"{what.successes:,} streams ended as the format ends one with not one event "
                   f"of text{usage}")
    if what.protocol_errors:
        quote = f" ({what.reason})" if what.reason else ""
        got.append(f"{what.protocol_errors:,} requests got events it could not parse{quote}")
    return (f"protocol mismatch: not one event of this run read as generated text, so nothing "
            f"after the first byte was measured: {expected(target.protocol, target.path)}; "
            f"in {', '.join(what.phases)}, {' and '.join(got)}"
            + f"; {seen or QUESTION}")


def mismatch_checks(scenario: Scenario, measured: Mapping[str, Stats], checks: list[Check],
                    seen: str | None = None) -> tuple[list[Check], list[str]]:
    """``checks`` with each one a protocol mismatch left without a value failed, and the
    mismatch's sentence as the run's warning; unchanged, and no warning, when the run read
    text. ``measured``: the scored phases' stats (warm-up left out), as ``evaluate`` got them."""
    what = unread(measured)
    if what is None:
        return checks, []
    sentence = mismatch_sentence(scenario, what, seen)
    out: list[Check] = []
    turned = False
    for check in checks:
        stats = measured.get(check.phase)
        if (check.kind == "slo" and check.ran and check.observed is None and check.measurable
                and stats is not None and (stats.successes or stats.errors.get("protocol"))):
            check = dataclasses.replace(check, passed=False, detail=sentence)
            turned |= check.gating
        out.append(check)
    if not turned and what.successes:
        # Nothing the scenario gates on needed text (error_rate alone): the run still measured
        # nothing it exists to measure.
        out.append(Check(name=CHECK_NAME, kind="protocol", phase=what.phases[0],
                         metric=CHECK_METRIC, op=">=", threshold=1.0, observed=0.0,
                         passed=False, gating=True, detail=sentence, samples=what.successes))
    return out, [sentence]
