"""A conversation class's session (its ``conversation``): which prompt each turn asks, the
history it sends (the system prefix, then every earlier turn's prompt and the answer as it was
received), and how the session ended. The locustfile runs the turns; the client sends each one
(``StreamClient.measure(turn=...)``) and keeps its answer's text for the next.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from streamquake.loadgen.plan import Conversation, RequestClassPlan
from streamquake.loadgen.samples import RequestSample, SessionEnd


@dataclass
class Turn:
    """One turn's request: its ``number`` (1 first), the session's ``system`` prefix, the
    earlier turns (prompt, answer received) and this turn's ``prompt``; ``answer`` is filled in
    by the client with the text this turn received."""

    number: int
    system: str
    history: list[tuple[str, str]]
    prompt: str
    answer: str = ""


@dataclass
class Session:
    """The turns of one session of class ``cls``, sent one after another."""

    cls: RequestClassPlan
    conversation: Conversation
    history: list[tuple[str, str]] = field(default_factory=list)

    def turn(self, number: int) -> Turn:
        """Turn ``number``: the class's prompts in order, round again when fewer."""
        prompts = self.cls.prompts or ["Say something."]
        return Turn(number, self.conversation.system, list(self.history),
                    prompts[(number - 1) % len(prompts)])

    def answered(self, turn: Turn) -> None:
        self.history.append((turn.prompt, turn.answer))

    def think_s(self, rng: random.Random) -> float:
        c = self.conversation
        return rng.uniform(c.think_min_s, c.think_max_s) if c.think_max_s > 0 else 0.0


def session_end(sample: RequestSample, number: int, turns: int) -> SessionEnd | None:
    """How the session ends with this turn's (final attempt's) ``sample``, None if it goes on:
    a failed turn fails it, a cancelled one (its class's ``cancel``) abandons it, and the last
    turn answered completes it. (The run's end coming before the next turn abandons it too:
    the locustfile tells.)"""
    if sample.error is not None:
        return "failed"
    if sample.cancelled:
        return "abandoned"
    if number >= turns:
        return "completed"
    return None
