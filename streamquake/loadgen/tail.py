"""Read what the load process appends to ``samples-<pid>.jsonl`` while a run lasts: complete
lines only, each once (a line still being written is read on the next pass)."""

from __future__ import annotations

import json
from pathlib import Path

from streamquake.loadgen.samples import RequestSample


class SampleTail:
    def __init__(self, samples_dir: Path) -> None:
        self.samples_dir = samples_dir
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[RequestSample]:
        """Every sample written since the last call, from every load process."""
        if not self.samples_dir.is_dir():
            return []
        new: list[RequestSample] = []
        for path in sorted(self.samples_dir.glob("samples-*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[path] = offset + end + 1
            for line in chunk[: end + 1].splitlines():
                try:
                    new.append(RequestSample.from_dict(json.loads(line)))
                except (ValueError, TypeError):
                    continue
        return new
