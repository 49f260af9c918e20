"""Read what the load process appends to ``samples-<pid>.jsonl`` while a run lasts: complete
lines only, each once (a line still being written is read on the next pass)."""

from __future__ import annotations

from pathlib import Path

import orjson

from streamquake.loadgen.samples import RequestSample


def new_lines(directory: Path, pattern: str, offsets: dict[Path, int]) -> list[bytes]:
    """Complete lines appended since the last call to the files ``pattern`` matches in
    ``directory``, each once; ``offsets`` (one per reader) remembers how far each file was
    read. A line still being written waits for the next call."""
    if not directory.is_dir():
        return []
    lines: list[bytes] = []
    for path in sorted(directory.glob(pattern)):
        offset = offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            continue
        end = chunk.rfind(b"\n")
        if end < 0:
            continue
        offsets[path] = offset + end + 1
        lines += chunk[: end + 1].splitlines()
    return lines


class SampleTail:
    def __init__(self, samples_dir: Path) -> None:
        self.samples_dir = samples_dir
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[RequestSample]:
        """Every sample written since the last call, from every load process."""
        new: list[RequestSample] = []
        for line in new_lines(self.samples_dir, "samples-*.jsonl", self._offsets):
            try:
                new.append(RequestSample.from_dict(orjson.loads(line)))
            except (ValueError, TypeError):
                continue
        return new


class RunSamples:
    """A finished run's per-request samples, for the stages after it that need requests one by
    one (time to recovery, a flapping fault's on/off split): read from the load processes'
    files once, on first use, and shared. The scorecards hold histograms, which stay small
    however long a run is; the requests themselves stay in their files until a stage asks."""

    def __init__(self, samples_dir: Path) -> None:
        self.samples_dir = samples_dir
        self._read: list[RequestSample] | None = None

    def all(self) -> list[RequestSample]:
        if self._read is None:
            self._read = SampleTail(self.samples_dir).poll()
        return self._read
