"""Every file a run leaves in its --out directory, written on every exit path (success, SLO
failure, interruption, a run that could not start): CI's test-report step always finds them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from streamquake.reports.csv_report import iter_samples, write_samples_csv, write_timeline_csv
from streamquake.reports.html import write_html
from streamquake.reports.json_report import write_json
from streamquake.reports.junit import write_junit
from streamquake.reports.markdown import write_markdown
from streamquake.result import RunResult


def write_reports(result: RunResult, out: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """report.json, junit.xml, summary.md, report.html, timeline.csv and, when the load process
    wrote any, samples.csv. Each is written to a temporary name and renamed into place, so a full
    disk loses only the file being written, never an earlier good one; returns (written,
    [(path, why) that could not be written])."""
    written: list[Path] = []
    failed: list[tuple[Path, str]] = []
    # A path given on the command line may hold bytes that are not UTF-8 (as surrogates), and
    # the texts that name it with it: every report says it escaped, rather than not be written.
    result.scenario_file, result.scenario_name = map(_utf8, (result.scenario_file,
                                                             result.scenario_name))
    result.errors[:] = map(_utf8, result.errors)
    if result.failure is not None:
        result.failure = _utf8(result.failure)

    def atomic(path: Path, write: Callable[[Path], object]) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
            written.append(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            failed.append((path, exc.strerror or str(exc)))

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return [], [(out, exc.strerror or str(exc))]
    atomic(out / "report.json", lambda p: write_json(result, p))
    atomic(out / "junit.xml", lambda p: write_junit(result, p))
    atomic(out / "summary.md", lambda p: write_markdown(result, p))
    atomic(out / "report.html", lambda p: write_html(result, p))
    atomic(out / "timeline.csv", lambda p: write_timeline_csv(result, p))
    samples_dir, csv_path = out / "run" / "samples", out / "samples.csv"
    if samples_dir.is_dir() and result.phases and any(samples_dir.glob("samples-*.jsonl")):
        # Streamed: a reused --out directory may hold an earlier run's samples, so only this
        # run's count; a run with none (load.samples: none) leaves no samples.csv.
        rows: list[int] = []
        atomic(csv_path, lambda p: rows.append(write_samples_csv(
            result, iter_samples(samples_dir, result.started_at), p)))
        if rows == [0]:
            csv_path.unlink(missing_ok=True)
            written.remove(csv_path)
    else:
        csv_path.unlink(missing_ok=True)
    return written, failed


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()
