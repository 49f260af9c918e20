"""Scorecards: what each load process scores, sent as standard histoblobs, merged by the runner.

The claim is exactness: merging any split of the requests gives the statistics of the union,
bucket for bucket, and each percentile is the raw union's nearest-rank value to the
histogram's 4 significant digits. A real run with ``load.samples: none`` scores every request
with no per-request lines written."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hdrh.histogram import HdrHistogram

from streamquake.errors import ScenarioError
from streamquake.loadgen.attribution import Window
from streamquake.loadgen.histogram import SparseHistogram
from streamquake.loadgen.metrics import HISTOGRAM_METRICS
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.loadgen.scorecard import Scorecard, read_scorecards
from streamquake.run.scoring import score
from streamquake.run.series import per_second
from streamquake.scenario.loader import parse_scenario
from streamquake.stats import percentile
from tests.helpers import assert_run_ok

T0 = 1_700_000_000.0
WINDOWS = [Window("warmup", T0, T0 + 2), Window("baseline", T0 + 2, T0 + 12),
           Window("fault", T0 + 12, T0 + 22), Window("recovery", T0 + 22, T0 + 32)]
SCENARIO = parse_scenario("""
name: split
target: {protocol: openai, embedded: {}}
load:
  users: 4
  classes: [{name: short, weight: 1}, {name: long, weight: 1}]
phases: {warmup: 2s, baseline: 10s, fault: 10s, recovery: 10s}
""")


def _requests(n: int, seed: int = 7) -> tuple[list[RequestSample], list[UnsentArrival]]:
    """Open-loop requests over the whole run and a little past it: some queued, some failed,
    some retried, some spanning phase edges, heavy-tailed latencies."""
    rng = random.Random(seed)
    samples, unsent = [], []
    for _ in range(n):
        cls = rng.choice(["short", "long", "unknown-class"])
        due = T0 + rng.uniform(-1.0, 33.0)
        if rng.random() < 0.03:
            unsent.append(UnsentArrival(cls=cls, scheduled=due, given_up=due + 1))
            continue
        sent = due + rng.expovariate(1 / 0.05)
        ttft = rng.lognormvariate(math.log(120), 0.6)
        gaps = [rng.lognormvariate(math.log(20), 0.8) for _ in range(rng.randint(0, 40))]
        gaps[::7] = [0.0] * len(gaps[::7])     # events read with the one before: one stamp
        error = rng.choice([None] * 12 + ["truncated", "http_status", "timeout"])
        s = RequestSample(cls=cls, sent=sent, scheduled=due, ttfb_ms=ttft * 0.8, ttft_ms=ttft,
                          ttfa_ms=ttft * 1.25,      # after some reasoning
                          send_ms=rng.choice([None, rng.uniform(0.05, 3.0)]),
                          dns_ms=rng.choice([None, 0.3]), connect_ms=rng.choice([None, 0.2]),
                          tls_ms=rng.choice([None, 1.5]), write_ms=rng.uniform(0.01, 0.5),
                          shared_stamps=len(gaps[::7]),
                          content_reads=len(gaps) + 1 - len(gaps[::7]),
                          burst_events=rng.choice([0, 0, len(gaps)]),   # some in bursts
                          itl_ms=gaps, e2e_ms=ttft + sum(gaps) + rng.uniform(0, 5),
                          output_tokens=len(gaps) + 1, content_events=len(gaps) + 1,
                          stalls=sum(g > 250 for g in gaps), client_stalls=rng.randint(0, 1),
                          missing_events=rng.randint(0, 1), expected_events=len(gaps) + 2,
                          error=error, error_detail=None if error is None else f"why {error}",
                          attempt=rng.choice([1, 1, 1, 2]))
        s.retried = error is not None and rng.random() < 0.2
        samples.append(s)
    return samples, unsent


def _split(samples: list[RequestSample], unsent: list[UnsentArrival], parts: int,
           tmp_path: Path) -> None:
    """Deal the records to ``parts`` scorecards, sealing as a process would, and write them."""
    rng = random.Random(3)

    def sink(i: int) -> Callable[[str], None]:
        def write(line: str) -> None:
            with open(tmp_path / f"seconds-{i}.jsonl", "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return write

    # Half the cards send their sealed seconds off as lines, as load processes do; the others
    # keep them (the in-memory path).
    cards = [Scorecard(WINDOWS, seal_after_s=5.0, seconds_sink=sink(i) if i % 2 == 0 else None)
             for i in range(parts)]
    for s in sorted(samples, key=lambda s: s.sent):
        card = rng.choice(cards)
        card.add(s)
        card.seal(s.sent)       # seconds sealed as time goes by; late requests reopen them
    for u in unsent:
        rng.choice(cards).add_unsent(u)
    for i, card in enumerate(cards):
        card.write(tmp_path / f"scorecard-{i}.json", final=True)


def test_merged_scorecards_equal_one_scorecard_of_the_union(tmp_path: Path) -> None:
    samples, unsent = _requests(3000)
    _split(samples, unsent, 3, tmp_path)
    assert len((tmp_path / "seconds-0.jsonl").read_text().splitlines()) > 20
    merged, problems = read_scorecards(tmp_path, WINDOWS)
    assert problems == []
    assert merged.processes == 3
    assert merged.records == len(samples) and merged.unsent == len(unsent)
    whole = Scorecard.of(WINDOWS, samples, unsent)
    a, b = score(SCENARIO, WINDOWS, merged), score(SCENARIO, WINDOWS, whole)
    for pa, pb in zip(a.phases, b.phases, strict=True):
        assert pa.stats == pb.stats, pa.name
        assert pa.classes == pb.classes, pa.name
        # The time batches behind the intervals merge exactly too (and are there to merge).
        sa, sb = a.stats[pa.name], b.stats[pa.name]
        assert sa.batches is not None and sa.batches == sb.batches, pa.name
        for metric, p in (("ttft_ms", 95.0), ("itl_ms", 50.0), ("error_rate", None),
                          ("not_sent_rate", None)):
            assert sa.effective_count(metric, p, 0.95) == sb.effective_count(metric, p, 0.95)
            assert (sa.rate_interval(metric, 0.95) if p is None else
                    sa.percentile_interval(metric, p, 0.95)) == (
                sb.rate_interval(metric, 0.95) if p is None else
                sb.percentile_interval(metric, p, 0.95)), (pa.name, metric)
    assert a.warnings == b.warnings
    assert per_second(merged, WINDOWS) == per_second(whole, WINDOWS)


def test_merged_percentiles_are_the_raw_unions_nearest_rank(tmp_path: Path) -> None:
    samples, unsent = _requests(3000)
    _split(samples, unsent, 4, tmp_path)
    merged, _ = read_scorecards(tmp_path, WINDOWS)
    stats = score(SCENARIO, WINDOWS, merged).stats["fault"]
    fault = WINDOWS[2]
    # ITL by the rule: every gap of every request due in the phase, wherever it fell, and a
    # timed-out stream's open gap at its lower bound (the percentiles' least possible value).
    mine = [s for s in samples if not s.retried
            and fault.start <= s.scheduled < fault.end]  # type: ignore[operator]
    gaps = sorted(g for s in mine for g in s.itl_ms)
    cut = sorted(s.e2e_ms - s.ttft_ms - sum(s.itl_ms)  # type: ignore[operator]
                 for s in mine if s.error == "timeout")
    assert stats.censored_count("itl_ms") == len(cut) > 10
    lowest = sorted(gaps + cut)
    assert stats.count("itl_ms") == len(gaps) > 1000
    for p in (1, 50, 90, 95, 99, 99.9, 100):
        raw = percentile(lowest, p)
        assert raw is not None
        got = stats.percentile("itl_ms", p)
        # The bucket's top: at or above the raw value, within 4 significant digits of it.
        assert got is not None and raw - 0.001 <= got <= raw * (1 + 2 ** -14) + 0.001, p


@pytest.mark.parametrize("n", [1, 40, 300, 20000])   # few buckets: our own encoder; many: hdrh's
def test_histoblobs_are_standard_hdr_histograms(n: int) -> None:
    rng = random.Random(1)
    sparse = SparseHistogram(4)
    dense = HdrHistogram(1, 3_600_000_000, 4)
    for _ in range(n):
        v = int(rng.lognormvariate(math.log(30000), 1.0)) * rng.choice([1, 1, 1, 40])
        sparse.record(v)
        dense.record_value(v)
    # Any HdrHistogram reads ours, and we read its.
    theirs = HdrHistogram.decode(sparse.encode().encode("ascii"))
    assert theirs.get_total_count() == n
    for p in (0.0, 10.0, 50.0, 90.0, 99.0, 99.9, 100.0):
        assert theirs.get_value_at_percentile(p) == dense.get_value_at_percentile(p), p
    assert SparseHistogram.decode(sparse.encode(), 4).counts == sparse.counts
    ours = SparseHistogram.decode(dense.encode().decode("ascii"), 4)
    assert ours.counts == sparse.counts
    with pytest.raises(ValueError, match="layout"):
        SparseHistogram.decode(sparse.encode(), 2)


def test_a_scorecard_for_other_windows_is_not_merged(tmp_path: Path) -> None:
    samples, unsent = _requests(200)
    _split(samples, unsent, 1, tmp_path)
    older = Scorecard([Window(w.name, w.start - 100, w.end - 100) for w in WINDOWS])
    older.add(samples[0])
    older.write(tmp_path / "scorecard-old.json", final=True)
    (tmp_path / "scorecard-torn.json").write_text('{"format": 1, "windows": [')
    merged, problems = read_scorecards(tmp_path, WINDOWS)
    assert merged.processes == 1 and merged.records == len(samples)
    assert len(problems) == 1 and "scorecard-torn.json could not be read" in problems[0]
    # A checkpoint never followed by the final card (a killed process) counts, and is named.
    checkpoint = Scorecard(WINDOWS)
    checkpoint.add(samples[0])
    checkpoint.write(tmp_path / "scorecard-killed.json")
    merged, problems = read_scorecards(tmp_path, WINDOWS)
    assert merged.processes == 2 and merged.records == len(samples) + 1
    assert problems[0].startswith("scorecard-killed.json is the last checkpoint of a load "
                                  "process that never saved its final scorecard")


def test_every_metric_crosses_the_wire() -> None:
    samples, unsent = _requests(500)
    card = Scorecard.of(WINDOWS, samples, unsent)
    back = Scorecard.from_wire(json.loads(card.dumps()))
    for key, stats in card.cells.items():
        assert back.cells[key].to_dict() == stats.to_dict()
    seen = {m for st in card.cells.values() for m in st.histograms}
    assert seen == set(HISTOGRAM_METRICS)


SAMPLES_NONE = """
name: no-samples
target:
  protocol: openai
  embedded: {{ttft: {{dist: normal, mean: 40ms, stddev: 5ms}}, output_tokens: {{min: 8, max: 8}}}}
load:
  users: 3
  samples: none
phases: {{warmup: 4s, baseline: 3s, fault: 0s, recovery: 0s}}
slos:
  - {{metric: ttft_ms, percentile: 95, max: 5000}}
"""


@pytest.mark.timeout(120)
def test_load_samples_none_scores_every_request_without_lines(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SAMPLES_NONE.format())
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "streamquake", "run", str(scenario),
                           "--out", str(out), "--no-watchdog"],
                          capture_output=True, text=True, timeout=110)
    assert_run_ok(proc, out)
    samples_dir = out / "run" / "samples"
    assert list(samples_dir.glob("samples-*.jsonl")) == []
    assert not (out / "samples.csv").exists()
    (card_file,) = (out / "run" / "scorecards").glob("scorecard-*.json")
    report = json.loads((out / "report.json").read_text())
    baseline = next(p for p in report["phases"] if p["name"] == "baseline")["stats"]
    card = json.loads(card_file.read_text())
    assert card["final"] is True
    assert not [e for e in report["errors"] if "scorecard" in e], report["errors"]
    assert baseline["requests"] > 10
    assert baseline["ttft_ms"]["count"] >= baseline["requests"]
    assert card["records"] >= sum(p["stats"]["sent"] for p in report["phases"])
    # Locust's own count of what the load process sent, against what was scored.
    log = (out / "run" / "locust.log").read_text()
    counts = [int(parts[2]) for line in log.splitlines()
              if (parts := line.split())[:2] == ["SSE", "default"] and parts[2].isdigit()]
    assert counts and counts[0] == card["records"]


def test_cells_of_phases_over_are_frozen_and_thawed_without_loss() -> None:
    """A load process keeps only the phases in progress as histograms; the rest as their wire
    form. Freezing everything after every request (a late one thaws its cell) changes
    nothing in what the card says."""
    samples, unsent = _requests(600)
    card = Scorecard(WINDOWS, seal_after_s=0.0)
    for s in sorted(samples, key=lambda s: s.sent):
        card.add(s)
        card.seal(T0 + 1000.0)
        assert not card.cells            # every cell frozen
    for u in unsent:
        card.add_unsent(u)
    back = Scorecard.from_wire(json.loads(card.dumps()))
    whole = Scorecard.of(WINDOWS, samples, unsent)
    assert sorted(back.cells) == sorted(whole.cells)
    for key, stats in whole.cells.items():
        assert back.cells[key].to_dict() == stats.to_dict(), key
    assert per_second(back, WINDOWS) == per_second(whole, WINDOWS)


def test_second_lines_count_up_to_the_cards_watermark(tmp_path: Path) -> None:
    """A process killed after sending seconds off but before its next card: the lines past
    the card's count hold requests the card does not, and are left out; lines missing that
    the card counts are named."""
    samples, _ = _requests(400)
    lines: list[str] = []
    card = Scorecard(WINDOWS, seconds_sink=lines.append)
    for s in sorted(samples, key=lambda s: s.sent):
        card.add(s)
    card.seal(T0 + 20.0)
    checkpoint = card.dumps(final=True)
    kept = len(lines)
    assert kept > 5 and card.seconds_lines == kept
    card.seal(T0 + 40.0)                 # more seconds sent off; then the process dies
    assert len(lines) > kept
    (tmp_path / "scorecard-a.json").write_text(checkpoint)
    (tmp_path / "seconds-a.jsonl").write_text("".join(x + "\n" for x in lines))
    merged, problems = read_scorecards(tmp_path, WINDOWS)
    assert problems == []
    whole = Scorecard.of(WINDOWS, samples)
    assert per_second(merged, WINDOWS) == per_second(whole, WINDOWS)
    (tmp_path / "seconds-a.jsonl").write_text("".join(x + "\n" for x in lines[:kept - 2]))
    _, problems = read_scorecards(tmp_path, WINDOWS)
    assert problems == [f"seconds-a.jsonl holds {kept - 2} of the {kept} seconds its card "
                        "counts: the timeline misses the rest"]


def test_abort_conditions_need_the_raw_samples() -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario("name: x\ntarget: {protocol: openai, embedded: {}}\n"
                       "load: {samples: none}\nphases: {baseline: 2s, fault: 0s, recovery: 0s}\n"
                       "abort_when:\n  - {metric: error_rate, above: 50%, for: 10s}\n",
                       "s.yaml")
    assert str(err.value) == (
        "s.yaml:5:1: abort_when: abort_when reads the live per-request samples, and "
        "load.samples is 'none': set load.samples to 'all' or remove abort_when")
