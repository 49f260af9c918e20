"""The envelope every fault shares in a scenario (toxiproxy's ToxicWrapper, in spirit).

Each injector module defines its own pydantic model that subclasses ``FaultSpec`` and adds a
``type: Literal["..."]`` field plus its parameters; ``scenario.py`` unions them on ``type``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

PhaseName = Literal["warmup", "baseline", "fault", "recovery"]


class FaultSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    phase: PhaseName = "fault"

    @property
    def label(self) -> str:
        return self.name or str(getattr(self, "type", "fault"))
