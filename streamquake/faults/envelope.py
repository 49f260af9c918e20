"""The envelope every fault shares in a scenario (toxiproxy's ToxicWrapper, in spirit).

Each family's spec module defines a pydantic model per fault type that subclasses ``FaultSpec``,
narrows ``type`` to ``Literal["..."]`` and adds its parameters; the scenario schema unions them on
``type`` (see ``catalog.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

PhaseName = Literal["warmup", "baseline", "fault", "recovery"]


class FaultSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    name: str | None = None
    phase: PhaseName = "fault"

    @property
    def label(self) -> str:
        return self.name or self.type
