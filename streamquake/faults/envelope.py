"""The envelope every fault shares in a scenario (toxiproxy's ToxicWrapper, in spirit).

Each family's spec module defines a pydantic model per fault type that subclasses ``FaultSpec``,
narrows ``type`` to ``Literal["..."]`` and adds its parameters; the scenario schema unions them on
``type`` (see ``catalog.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from streamquake.faults.flap import Flap
from streamquake.units import PlainName, ScenarioModel

PhaseName = Literal["warmup", "baseline", "fault", "recovery"]
LOCAL = "local"


class FaultSpec(ScenarioModel):
    type: str
    name: PlainName | None = None
    phase: PhaseName = "fault"
    # Where the fault runs: None (``at: local``, the default) in this process; else the name of
    # an agent in the scenario's ``agents:``, which holds it under a lease (streamquake/agent).
    at: str | None = None

    @field_validator("at")
    @classmethod
    def _local_is_none(cls, v: str | None) -> str | None:
        # One spelling of "here", so specs dumped with exclude_none stay as they were.
        return None if v is None or v.strip() in ("", LOCAL) else v.strip()

    # Switched on and off inside the fault's window rather than on throughout (faults/flap.py).
    flap: Flap | None = None

    @property
    def label(self) -> str:
        return self.name or self.type


# The envelope's fields, in order (``type`` first): what every fault takes besides its own.
ENVELOPE: tuple[str, ...] = tuple(FaultSpec.model_fields)
