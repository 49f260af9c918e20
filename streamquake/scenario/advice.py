"""Warnings about a valid scenario that will not measure what it seems to ask for.

``validate`` prints them and ``run`` repeats them in the report; they never stop a run."""

from __future__ import annotations

from streamquake.scenario.schema import Scenario


def scenario_warnings(scenario: Scenario) -> list[str]:
    warnings: list[str] = []
    slos = [*scenario.slos, *(s for c in scenario.load.classes for s in c.slos)]
    if any(s.metric == "chunk_loss" for s in slos):
        embedded = scenario.target.embedded
        if embedded is not None and not embedded.sse_event_ids:
            warnings.append(
                "chunk_loss counts gaps in SSE event ids, and the embedded target numbers its "
                "events only with target.embedded.sse_event_ids: true; without it chunk_loss "
                "will be reported as not measurable")
        elif embedded is None:
            warnings.append(
                "chunk_loss counts gaps in SSE event ids; it is measurable only if the target "
                "numbers its events (`id:` lines), which the Gemini, OpenAI and Anthropic APIs "
                "do not")
    for f in scenario.faults:
        if f.flap is None:
            continue
        on, off = f.flap.typical_s("on"), f.flap.typical_s("off")
        for step in (s for s in scenario.timeline if f.label in s.faults):
            if on + off > step.duration_s:
                warnings.append(
                    f"fault '{f.label}' flaps on {on:g}s / off {off:g}s, longer than its "
                    f"{'phase' if scenario.phases else 'step'} '{step.name}' "
                    f"({step.duration_s:g}s): it switches at most once or twice, so its "
                    "on/off split measures little")
    return warnings
