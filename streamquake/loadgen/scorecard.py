"""Each load process scores its own requests as they end, into a scorecard that merges exactly.

A scorecard holds, per (phase, request class), the counts and sparse HDR histograms of
``Stats`` (loadgen/metrics.py), and per second of the run the timeline's counts and coarse
histograms. The phase windows travel in the load plan, so a process knows where each
measurement belongs; the rule is below and in docs/measurement.md ("Which phase a measurement counts
in"). Scorecards cross processes and hosts as JSON with standard HdrHistogram V2 histoblobs:
a local process writes ``scorecard-<pid>.json`` every :data:`CHECKPOINT_S`, a remote worker
sends it to the master as a Locust custom message (loadgen/relay.py). The runner merges them
(adding counts bucket by bucket: the union's percentiles, exactly) and scores from that, so
its time and memory do not grow with the number of requests.

Which step each measurement counts in is loadgen/attribution.py's rule.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Generator, Iterable, Sequence
from pathlib import Path
from typing import Any

from streamquake.jsontypes import JsonDict, compact
from streamquake.loadgen.attribution import (
    Window,
    WindowLike,
    attribute,
    due_at,
    ended_at,
    window_at,
)
from streamquake.loadgen.batches import TimeBatches
from streamquake.loadgen.histogram import SparseHistogram
from streamquake.loadgen.holds import run_through
from streamquake.loadgen.metrics import Stats
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.metric_catalog import names

FORMAT = 1
CHECKPOINT_S = 2.0
# The timeline's histograms per second: 2 significant digits (buckets under 1% wide) are
# plenty to draw a p50/p95 line, and keep each second to a few hundred buckets.
SECOND_SIG_FIGS = 2
SECOND_GRACE_S = 3.0      # a second is sent off this long after it ended (seconds_sink)
SERIES_METRICS: tuple[str, ...] = names(series=True)     # each second's p50/p95 (series_values)
_PENDING_STEP = 4       # records scored per step after a checkpoint


class Second:
    """One second of the timeline, by when requests were due: what was sent, failed, and the
    coarse histograms of their measurements. Once nothing is likely to land in it any more
    its histograms are sealed into packed (index, count) pairs (small, read back with no
    decoding loop); a late request starts a new part, and merging only collects parts."""

    __slots__ = ("sent", "errors", "hists", "parts")

    def __init__(self) -> None:
        self.sent = 0
        self.errors = 0
        self.hists: dict[str, SparseHistogram] = {}
        self.parts: list[dict[str, str]] = []

    def hist(self, metric: str) -> SparseHistogram:
        h = self.hists.get(metric)
        if h is None:
            h = self.hists[metric] = SparseHistogram(SECOND_SIG_FIGS)
        return h

    def seal(self) -> None:
        if self.hists:
            self.parts.append(_pack(self.hists))
            self.hists = {}

    def merge(self, other: Second) -> None:
        self.sent += other.sent
        self.errors += other.errors
        self.parts += other.parts
        for metric, h in other.hists.items():
            self.hist(metric).merge(h)

    def histogram(self, metric: str) -> SparseHistogram:
        """The second's ``metric`` over every part (decoded now, kept nowhere)."""
        out = SparseHistogram(SECOND_SIG_FIGS)
        if (live := self.hists.get(metric)) is not None:
            out.merge(live)
        for part in self.parts:
            if (packed := part.get(metric)) is not None:
                out.merge(SparseHistogram.unpack(packed, SECOND_SIG_FIGS))
        return out

    def to_wire(self) -> dict[str, object]:
        parts = self.parts + ([_pack(self.hists)] if self.hists else [])
        return {"sent": self.sent, "errors": self.errors, "parts": parts}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Second:
        out = cls()
        out.sent, out.errors = int(data.get("sent", 0)), int(data.get("errors", 0))
        out.parts = [{str(m): str(packed) for m, packed in part.items()}
                     for part in data.get("parts", [])]
        return out


def _pack(hists: dict[str, SparseHistogram]) -> dict[str, str]:
    return {m: h.pack() for m, h in hists.items() if h.total}


def _cell_text(key: tuple[str, str], stats: Stats) -> str:
    return compact({"phase": key[0], "class": key[1], "stats": stats.to_wire()})


class Scorecard:
    """Everything the verdicts, CDFs and timeline need, from one or many load processes."""

    def __init__(self, windows: Sequence[WindowLike], seal_after_s: float = 75.0,
                 seconds_sink: Callable[[str], None] | None = None) -> None:
        self.windows = [Window(w.name, w.start, w.end) for w in windows]
        self.t0 = self.windows[0].start if self.windows else 0.0
        self.seal_after_s = seal_after_s
        # Where sealed seconds go as they are sealed, one JSON line each (a file, or the relay
        # to the master), so that a load process's memory does not grow with the run's length;
        # the card then holds only the seconds still open, and counts the lines written.
        self.seconds_sink = seconds_sink
        self.seconds_lines = 0
        self.cells: dict[tuple[str, str], Stats] = {}
        self.seconds: dict[int, Second] = {}
        self.starts: dict[int, int] = {}   # requests sent, by half-second-centred slot
        self.ends: dict[int, int] = {}     # requests ended, likewise (for in-flight counts)
        self.first_sent: float | None = None
        self.records = 0                   # request records scored (attempts included)
        self.unsent = 0                    # arrivals never sent, scored
        self.outside = 0                   # records due outside every phase (before, after)
        self.processes = 1
        self._dirty: set[tuple[str, str]] = set()
        # Each cell's entry in the wire form, as JSON text, as of its last encoding; only
        # cells changed since (``_dirty``) are encoded again.
        self._text: dict[tuple[str, str], str] = {}
        # Cells of phases long over, kept only as their text (a late request thaws one).
        self._frozen: set[tuple[str, str]] = set()
        self._ends = {w.name: w.end for w in self.windows}
        self._spans = {w.name: (w.start, w.end) for w in self.windows}
        self._sealed_below = 0
        # While a checkpoint is taken in steps, records wait here (scored right after it), so
        # the card it writes is one instant's, however many times it gave the hub back.
        self._busy = False
        self._pending: list[RequestSample | UnsentArrival] = []

    # -- scoring --------------------------------------------------------------------------

    def cell(self, phase: str, cls: str) -> Stats:
        key = (phase, cls)
        self._dirty.add(key)
        stats = self.cells.get(key)
        if stats is None:
            if key in self._frozen:
                self._frozen.discard(key)
                stats = Stats.from_wire(json.loads(self._text[key])["stats"])
            else:
                start, end = self._spans.get(phase, (0.0, 0.0))
                stats = Stats(batches=TimeBatches.over(start, end))
            self.cells[key] = stats
        return stats

    @property
    def pending(self) -> int:
        """Records waiting for a checkpoint in progress to end."""
        return len(self._pending)

    def add(self, s: RequestSample) -> None:
        if self._busy:
            self._pending.append(s)
            return
        self.records += 1
        if self.first_sent is None or s.sent < self.first_sent:
            self.first_sent = s.sent
        if not attribute(s, self.windows, lambda phase: self.cell(phase, s.cls)):
            self.outside += 1
        if not s.retried:
            self._timeline(s)

    def add_unsent(self, u: UnsentArrival) -> None:
        if self._busy:
            self._pending.append(u)
            return
        self.unsent += 1
        home = window_at(u.scheduled, self.windows)
        if home is None:
            self.outside += 1
            return
        self.cell(home.name, u.cls).add_not_sent(u.scheduled)

    def _timeline(self, s: RequestSample) -> None:
        slot = max(0, math.floor(s.sent - self.t0 + 0.5))
        self.starts[slot] = self.starts.get(slot, 0) + 1
        end = max(0, math.floor(ended_at(s) - self.t0 + 0.5))
        self.ends[end] = self.ends.get(end, 0) + 1
        i = math.floor(due_at(s) - self.t0)
        if i < 0:
            return
        second = self.seconds.get(i)
        if second is None:
            second = self.seconds[i] = Second()
        second.sent += 1
        second.errors += s.error is not None
        for metric, values in series_values(s):
            second.hist(metric).record_ms(values)

    def seal(self, now: float) -> None:
        """Seal what no request is likely still running for, at once (see :meth:`seal_steps`)."""
        run_through(self.seal_steps(now))

    def seal_steps(self, now: float) -> Generator[None, None, None]:
        """Seal what no request is likely still running for: seconds (a late request opens a
        new part) and the cells of phases over (kept as their text only; a late request
        thaws one). So a load process's memory holds the phases in progress, not the run.
        Yields after each second and each cell: records may be scored in between. Records
        waiting (:meth:`defer`) are scored first."""
        yield from self._score_pending()
        if self.seconds_sink is not None:
            # Late requests only add a line of their own, so seconds leave soon after they end.
            for i in [i for i in self.seconds if i < math.floor(now - self.t0 - SECOND_GRACE_S)]:
                second = self.seconds.pop(i, None)
                if second is None:
                    continue
                self.seconds_sink(compact({"i": i, "sent": second.sent, "errors": second.errors,
                                           "part": _pack(second.hists)}))
                self.seconds_lines += 1
                yield
        below = math.floor(now - self.t0 - self.seal_after_s)
        if below > self._sealed_below:
            for i, second in list(self.seconds.items()):
                if i < below and second.hists:
                    second.seal()
                    yield
            self._sealed_below = below
        over = now - self.seal_after_s
        for key in [k for k in self.cells if self._ends.get(k[0], math.inf) < over]:
            stats = self.cells.pop(key, None)
            if stats is None:
                continue
            if key in self._dirty or key not in self._text:
                self._text[key] = _cell_text(key, stats)
            self._dirty.discard(key)
            self._frozen.add(key)
            yield

    # -- across processes ------------------------------------------------------------------

    def merge(self, other: Scorecard) -> None:
        """Add ``other`` into this card; ``other`` gives up its parts and must not be used."""
        for key, stats in other.cells.items():
            self._take(key, stats)
        for i, second in other.seconds.items():
            here = self.seconds.get(i)
            if here is None:
                self.seconds[i] = second
            else:
                here.merge(second)
        for slots, more in ((self.starts, other.starts), (self.ends, other.ends)):
            for slot, n in more.items():
                slots[slot] = slots.get(slot, 0) + n
        if other.first_sent is not None and (self.first_sent is None
                                             or other.first_sent < self.first_sent):
            self.first_sent = other.first_sent
        self.records += other.records
        self.unsent += other.unsent
        self.outside += other.outside
        self.processes += other.processes

    def to_wire(self, final: bool = False) -> JsonDict:
        return dict(json.loads(self.dumps(final)))

    def dump_steps(self, final: bool = False) -> Generator[None, None, list[str]]:
        """The card's wire form as JSON text, taken in steps (one histogram of a changed cell,
        the rest of that cell, or one open second, a step): while they run, records wait
        (:attr:`pending`) and are scored after, so the text is one instant's card. Returns
        the text in parts (the head, then each cell), never joined here: joining a card of
        386 cells (1.9 MB) in one piece held the hub for 10-12 ms of CPU, most of it the
        page faults of three fresh 2 MB copies; the writer (:func:`replace_text`) writes the
        parts one after another, off the hub."""
        yield from self._score_pending()
        self._busy = True
        try:
            for key in list(self._dirty):
                stats = self.cells.get(key)
                if stats is not None:
                    for hist in stats.histograms.values():
                        hist.encode()           # a step each (kept until it changes)
                        yield
                    self._text[key] = _cell_text(key, stats)
                self._dirty.discard(key)
                yield
            seconds: list[str] = []
            for i, second in sorted(self.seconds.items()):
                seconds.append(f'"{i}":' + compact(second.to_wire()))
                yield
            head = compact({
                "format": FORMAT,
                "pid": os.getpid(),
                "final": final,
                "windows": [[w.name, w.start, w.end] for w in self.windows],
                "first_sent": self.first_sent,
                "records": self.records,
                "unsent": self.unsent,
                "outside": self.outside,
                "seconds_lines": self.seconds_lines,
                "starts": {str(k): v for k, v in sorted(self.starts.items())},
                "ends": {str(k): v for k, v in sorted(self.ends.items())},
            })
            parts = [head[:-1] + ',"seconds":{' + ",".join(seconds) + '},"cells":[']
            for n, k in enumerate(sorted(self._text)):
                parts.append("," + self._text[k] if n else self._text[k])
            parts.append("]}")
        finally:
            self._busy = False
        yield from self._score_pending()
        return parts

    def defer(self, record: RequestSample | UnsentArrival) -> None:
        """Score ``record`` later, with the others that ended meanwhile (:meth:`score_steps`;
        a checkpoint and a seal score what waits first): a load process reading hundreds of
        streams between two requests' ends finds the card's cells and its own code cold in the
        CPU's caches for each request, and warm for the second of a batch on."""
        self._pending.append(record)

    def score_steps(self) -> Generator[None, None, None]:
        """Score the records waiting (:meth:`defer`), a few a step; while a checkpoint runs,
        none (it scores them once its card is taken)."""
        yield from self._score_pending()

    def _score_pending(self) -> Generator[None, None, None]:
        while self._pending and not self._busy:
            batch, self._pending = self._pending[:_PENDING_STEP], self._pending[_PENDING_STEP:]
            for record in batch:
                if isinstance(record, RequestSample):
                    self.add(record)
                else:
                    self.add_unsent(record)
            yield

    @classmethod
    def from_wire(cls, data: dict[str, Any], cells: bool = True) -> Scorecard:
        """A card from its wire form; ``cells=False`` leaves its cells out (see
        :meth:`merge_cells`)."""
        if data.get("format") != FORMAT:
            raise ValueError(f"scorecard format {data.get('format')!r}, expected {FORMAT}")
        card = cls([Window(str(n), float(a), float(b)) for n, a, b in data["windows"]])
        if cells:
            card.merge_cells(data.get("cells", []))
        card.seconds = {int(i): Second.from_wire(s) for i, s in data.get("seconds", {}).items()}
        card.starts = {int(k): int(v) for k, v in data.get("starts", {}).items()}
        card.ends = {int(k): int(v) for k, v in data.get("ends", {}).items()}
        first = data.get("first_sent")
        card.first_sent = None if first is None else float(first)
        card.records = int(data.get("records", 0))
        card.unsent = int(data.get("unsent", 0))
        card.outside = int(data.get("outside", 0))
        card.seconds_lines = int(data.get("seconds_lines", 0))
        return card

    def merge_cells(self, cells: list[dict[str, Any]]) -> None:
        """Add cells in wire form, one at a time: only one is ever decoded beside this card's
        (a whole card decoded first would double the runner's peak)."""
        for cell in cells:
            self._take((str(cell["phase"]), str(cell["class"])), Stats.from_wire(cell["stats"]))

    def _take(self, key: tuple[str, str], stats: Stats) -> None:
        """Add ``stats`` to the cell ``key``; a new cell takes ``stats`` itself, not a copy (its
        giver must not use it after this)."""
        self._dirty.add(key)
        mine = self.cells.get(key)
        if mine is None:
            self.cells[key] = stats
        else:
            mine.merge(stats)

    def add_second_lines(self, lines: Iterable[bytes | str]) -> None:
        """Seconds that a load process sealed and sent off as lines (``seconds_sink``)."""
        for line in lines:
            data = json.loads(line)
            second = Second.from_wire({"sent": data["sent"], "errors": data["errors"],
                                       "parts": [data["part"]]})
            here = self.seconds.get(int(data["i"]))
            if here is None:
                self.seconds[int(data["i"])] = second
            else:
                here.merge(second)

    def dumps(self, final: bool = False) -> str:
        """The wire form as JSON text, at once (see :meth:`dump_steps`)."""
        return "".join(run_through(self.dump_steps(final)))

    def write(self, path: Path, final: bool = False) -> None:
        """Replace ``path`` atomically: a reader (or a kill) never sees half a scorecard, and a
        write that fails (a full disk) leaves the last good one."""
        replace_text(path, self.dumps(final))

    @classmethod
    def of(cls, windows: Sequence[WindowLike], samples: Iterable[RequestSample],
           unsent: Iterable[UnsentArrival] = ()) -> Scorecard:
        card = cls(windows)
        for s in samples:
            card.add(s)
        for u in unsent:
            card.add_unsent(u)
        return card


def series_values(s: RequestSample) -> list[tuple[str, Sequence[float]]]:
    """What ``s`` adds to each of :data:`SERIES_METRICS`: the same definitions as ``Stats``
    (a failed stream's E2E says how it failed, so only successful ones count)."""
    out: list[tuple[str, Sequence[float]]] = []
    if s.ttfb_ms is not None:
        out.append(("ttfb_ms", (s.ttfb_ms,)))
    if s.ttft_ms is not None:
        out.append(("ttft_ms", (s.ttft_ms,)))
    if s.itl_ms:
        out.append(("itl_ms", s.itl_ms))
    if s.error is None and s.e2e_ms is not None:
        out.append(("e2e_ms", (s.e2e_ms,)))
    if (tps := s.tokens_per_s) is not None:
        out.append(("output_tokens_per_s", (tps,)))
    return out


def replace_text(path: Path, text: str | Sequence[str]) -> None:
    """Replace ``path`` with ``text`` (a string, or its parts in order) atomically (a temporary
    file renamed over it): a reader, or a kill, never sees half of it, and a write that fails
    leaves the last good one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            if isinstance(text, str):
                f.write(text)
            else:
                f.writelines(text)   # part by part: each encoded alone, no whole copy
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _first_lines(path: Path, n: int) -> list[bytes]:
    if n <= 0:
        return []
    try:
        with open(path, "rb") as f:
            lines = list(itertools.islice(f, n))
    except OSError:
        return []
    return [line for line in lines if line.endswith(b"\n")]


def read_scorecards(directory: Path, windows: Sequence[WindowLike]
                    ) -> tuple[Scorecard, list[str]]:
    """Merge every ``scorecard-*.json`` in ``directory`` written for these phase windows (a
    reused folder may hold an earlier run's). Returns (the merged card, problems): a file
    that could not be read, or a card that is not its process's final one; each is a run
    warning, in one sentence."""
    merged = Scorecard(windows)
    merged.processes = 0
    want = [[w.name, w.start, w.end] for w in windows]
    problems: list[str] = []
    for path in sorted(directory.glob("scorecard-*.json")) if directory.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("windows") != want:
                continue
            card = Scorecard.from_wire(data, cells=False)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{path.name} could not be read, so that load process's requests "
                            f"are missing from every figure: {exc}")
            continue
        # Its sealed seconds: the lines written before this card was (a later line belongs to
        # a checkpoint that never landed, and its requests are not in the card either).
        lines_path = path.with_name("seconds-" + path.name.removeprefix("scorecard-")
                                    ).with_suffix(".jsonl")
        lines = _first_lines(lines_path, card.seconds_lines)
        try:
            card.add_second_lines(lines)
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{lines_path.name} could not be read: the timeline misses "
                            f"seconds of that load process ({exc})")
        if len(lines) < card.seconds_lines:
            problems.append(f"{lines_path.name} holds {len(lines)} of the "
                            f"{card.seconds_lines} seconds its card counts: the timeline "
                            "misses the rest")
        merged.merge(card)
        try:
            merged.merge_cells(data.get("cells", []))
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{path.name} could not be read whole, so that load process's "
                            f"requests are missing from the figures, in part or in whole: {exc}")
        if not data.get("final"):
            problems.append(f"{path.name} is the last checkpoint of a load process that never "
                            "saved its final scorecard (killed, or it could not write at the "
                            f"end), so up to its last {CHECKPOINT_S:g} s of requests are "
                            "missing from the figures")
    return merged, problems
