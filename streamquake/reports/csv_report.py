"""timeline.csv (the per-second series the HTML report draws) and samples.csv (one row per
request, as the load process measured it), for people who use spreadsheets."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from streamquake.loadgen.attribution import due_at, ended_at, window_at
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.scorecard import SERIES_METRICS
from streamquake.result import RunResult
from streamquake.run.timeline import PhaseWindow
from streamquake.stats import percentile


def write_timeline_csv(result: RunResult, path: Path) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        head = ["t_s", "phase", "sent", "errors", "in_flight"]
        for m in SERIES_METRICS:
            head += [f"{m}_p50", f"{m}_p95", f"{m}_n"]
        out.writerow(head)
        for p in result.timeline:
            row: list[object] = [f"{p.t:g}", p.phase, p.sent, p.errors, p.in_flight]
            for m in SERIES_METRICS:
                row += [_num(p.p50.get(m)), _num(p.p95.get(m)), p.n.get(m, 0)]
            out.writerow(row)
    return path


def iter_samples(samples_dir: Path, since: float = 0.0) -> Iterator[RequestSample]:
    """Every sample the load processes wrote (sent at or after ``since``: a reused folder may
    hold an earlier run's), file by file, one at a time; a torn last line (a killed writer) is
    skipped."""
    for path in sorted(samples_dir.glob("samples-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    s = RequestSample.from_dict(json.loads(line))
                except (ValueError, TypeError):
                    continue
                if s.sent >= since:
                    yield s


def read_samples(samples_dir: Path) -> list[RequestSample]:
    """Every sample the load processes wrote, in memory (``compare``'s bootstrap needs them)."""
    return list(iter_samples(samples_dir))


SAMPLE_COLUMNS = ("phase", "scored", "class", "sent_epoch_s", "t_s", "scheduled_epoch_s",
                  "ttfb_ms", "ttft_ms", "e2e_ms", "itl_n", "itl_p50_ms", "itl_max_ms",
                  "content_events", "output_tokens", "missing_events", "expected_events",
                  "stalls", "client_stalls", "clock", "status", "error", "error_detail",
                  "send_ms", "dns_ms", "connect_ms", "tls_ms", "write_ms", "reused",
                  "trace_id", "body_bytes", "shared_stamps", "response_id", "usage_tokens", "model",
                  "finish_reason", "content_reads", "burst_events", "burst_reads",
                  "bunched", "cancelled", "turn", "session", "cache_n", "prompt_n")


def write_samples_csv(result: RunResult, samples: Iterable[RequestSample], path: Path) -> int:
    """One row per request, streamed (memory does not grow with the run): load process by load
    process, each in the order its requests ended; sort on ``sent_epoch_s`` for send order.
    ``usage_tokens`` empty: the server sent no usage, and ``output_tokens`` counts content events.
    ``scored``: ``yes`` (every measurement counted in its phase, where it ended), ``ended_after``
    (it ended after its phase did, and is counted in its phase all the same: see
    loadgen/scorecard.py), or ``no`` (due outside every phase). ``cancelled``: the client
    abandoned it (its class's ``cancel``); its ``e2e_ms`` is then when it closed the stream.
    ``turn``: a conversation's turn number; ``session``: on a session's last turn, how the
    session ended (completed, failed, abandoned). ``cache_n``, ``prompt_n``: the prompt tokens
    the server said it read from its prefix cache and anew (llama-server's ``timings``).
    Returns the number of rows."""
    windows = [PhaseWindow(p.name, p.start, p.end) for p in result.phases]
    t0 = windows[0].start if windows else result.started_at
    rows = 0
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(SAMPLE_COLUMNS)
        for s in samples:
            home = window_at(due_at(s), windows)
            phase = "" if home is None else home.name
            state = "no" if home is None else (
                "yes" if ended_at(s) <= home.end else "ended_after")
            gaps = sorted(s.itl_ms)
            out.writerow([phase, state, s.cls, f"{s.sent:.6f}", f"{s.sent - t0:.3f}",
                          "" if s.scheduled is None else f"{s.scheduled:.6f}",
                          _num(s.ttfb_ms), _num(s.ttft_ms), _num(s.e2e_ms), len(gaps),
                          _num(percentile(gaps, 50)), _num(gaps[-1] if gaps else None),
                          s.content_events, s.output_tokens, s.missing_events, s.expected_events,
                          s.stalls, s.client_stalls, s.clock,
                          "" if s.status is None else s.status, s.error or "",
                          s.error_detail or "", _num(s.send_ms), _num(s.dns_ms),
                          _num(s.connect_ms), _num(s.tls_ms), _num(s.write_ms),
                          "yes" if s.reused else "no", s.trace_id or "", s.body_bytes,
                          s.shared_stamps,
                          s.response_id or "",
                          "" if s.usage_tokens is None else s.usage_tokens, s.model or "",
                          s.finish_reason or "", s.content_reads, s.burst_events,
                          s.burst_reads, _yes_no(s.bunched), _yes_no(s.cancelled),
                          "" if s.turn is None else s.turn, s.session or "",
                          "" if s.cache_n is None else s.cache_n,
                          "" if s.prompt_n is None else s.prompt_n])
            rows += 1
    return rows


def _yes_no(value: bool | None) -> str:
    return "" if value is None else "yes" if value else "no"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
