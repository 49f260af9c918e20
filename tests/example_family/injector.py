"""The example family's injector and run-long resource (see __init__.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from streamquake.errors import RevertError
from streamquake.faults.contract import JsonDict, RunContext, TelemetryChart, Wiring, charted
from streamquake.journal import JournalEntry
from tests.example_family import MarkerFileFault


class MarkerFileInjector:
    def __init__(self, spec: MarkerFileFault, ctx: RunContext) -> None:
        self.spec = spec
        self.path = Path(spec.path)

    def preflight(self) -> list[str]:
        if not self.path.parent.is_dir():
            return [f"{self.path.parent} does not exist: create it or pick another `path`"]
        if self.path.exists():
            return [f"{self.path} exists already: this fault would overwrite it"]
        return []

    def apply(self, entry: JournalEntry) -> JsonDict:
        entry.save({"path": str(self.path)})       # journal first: a kill from here on is undone
        self.path.write_text(self.spec.content)
        self.path.chmod(int(self.spec.mode, 8))
        return {"path": str(self.path), "bytes": len(self.spec.content.encode())}

    def revert(self) -> JsonDict:
        return {"removed": _remove(self.path)}

    @classmethod
    def recover(cls, state: dict[str, object]) -> str:
        path = state.get("path")
        if not isinstance(path, str):
            return "nothing to undo: the fault never wrote its file"
        return f"removed {path}" if _remove(Path(path)) else f"{path} was already gone"


def _remove(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False                                # already gone is success, never an error
    except OSError as exc:
        raise RevertError(f"cannot remove {path}: {exc.strerror}; remove it by hand") from exc
    return True


CHARTS = (TelemetryChart("up_s", "Parts up", "s"),)


class Stopwatch:
    """A run-long resource: how long the run's parts were up (shows in telemetry.stopwatch)."""

    key = "stopwatch"
    title = "the example stopwatch"
    stage: Literal["before_target", "after_target"] = "after_target"

    def __init__(self) -> None:
        self.started: float | None = None
        self.stopped: float | None = None

    def start(self, ctx: RunContext, wiring: Wiring) -> None:
        self.started = time.time()

    def stop(self) -> None:
        self.stopped = time.time()

    def report(self) -> JsonDict | None:
        if self.started is None or self.stopped is None:
            return None
        up = round(self.stopped - self.started, 3)
        # Charted in report.html like the GPU family's telemetry: any family's samples can be.
        return {"up_s": up, **charted(
            [{"t": self.started, "up_s": 0.0}, {"t": self.stopped, "up_s": up}],
            "Example stopwatch", "how long the run's parts were up", CHARTS)}
