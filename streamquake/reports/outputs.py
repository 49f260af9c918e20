"""Every file a run leaves in its --out directory, written on every exit path (success, SLO
failure, interruption, a run that could not start): CI's test-report step always finds them."""

from __future__ import annotations

from pathlib import Path

from streamquake.reports.csv_report import read_samples, write_samples_csv, write_timeline_csv
from streamquake.reports.html import write_html
from streamquake.reports.json_report import write_json
from streamquake.reports.junit import write_junit
from streamquake.reports.markdown import write_markdown
from streamquake.result import RunResult


def write_reports(result: RunResult, out: Path) -> list[Path]:
    """report.json, junit.xml, summary.md, report.html, timeline.csv and, when the load process
    wrote any, samples.csv."""
    out.mkdir(parents=True, exist_ok=True)
    written = [
        write_json(result, out / "report.json"),
        write_junit(result, out / "junit.xml"),
        write_markdown(result, out / "summary.md"),
        write_html(result, out / "report.html"),
        write_timeline_csv(result, out / "timeline.csv"),
    ]
    samples_dir, csv_path = out / "run" / "samples", out / "samples.csv"
    # A reused --out directory may hold an earlier run's samples: only this run's count.
    samples = [s for s in read_samples(samples_dir) if s.sent >= result.started_at] \
        if samples_dir.is_dir() and result.phases else []
    if samples:
        written.append(write_samples_csv(result, samples, csv_path))
    else:
        csv_path.unlink(missing_ok=True)
    return written
