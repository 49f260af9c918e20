"""Flapping faults (envelope ``flap``): a fault switched on and off inside its window.

Real runs against the embedded target through the SSE proxy: the per-second timeline shows the
on/off pattern (seconds inside on-states against seconds inside off-states of the same run), each
edge is recorded and journalled, the phase's measurements are split by state; a SIGKILL while the
fault is on leaves it in the journal and `streamquake recover` removes it. Validation errors are
located in the file."""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

from streamquake.errors import ScenarioError
from streamquake.faults.flap import Flap
from streamquake.scenario.advice import scenario_warnings
from streamquake.scenario.loader import parse_scenario
from tests.conftest import REPO, cli_cmd, run_cli
from tests.helpers import assert_run_ok, wait_for_line
from tests.test_network_cli import _ours_in_kernel

HEAD = """name: {name}
target:
  protocol: openai
  embedded: {{ttft: 60ms, itl: 5ms, output_tokens: {{min: 10, max: 10}}, seed: 3}}
  timeout: 10s
load: {{users: 4, think_time: {{min: 20ms, max: 50ms}}, seed: 3}}
phases: {{warmup: 1s, baseline: 2s, fault: {fault_s}, recovery: 2s}}
"""
SLOW = "  - {{type: sse_proxy, name: slow, phase: fault, first_event_delay: 300ms, flap: {flap}}}\n"
# Answers through a thin pipe in the target's own namespace: slow while on, quick while off.
THIN = ("network: {{mode: namespace, scope: target, direction: both}}\n"
        "faults:\n  - {{type: tbf, name: thin, phase: fault, rate: 50kbit, burst: 4kb, "
        "flap: {flap}}}\n")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


def _scenario(tmp_path: Path, flap: str, fault_s: str = "8s", name: str = "flap") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(HEAD.format(name=name, fault_s=fault_s) + "faults:\n"
                    + SLOW.format(flap=flap))
    return path


def _tbf_scenario(tmp_path: Path, flap: str, fault_s: str = "8s", name: str = "flap-tbf"
                  ) -> Path:
    path = tmp_path / f"{name}.yaml"
    # Open loop, so every second sends alike whether the pipe is thin or not.
    head = HEAD.format(name=name, fault_s=fault_s).replace(
        "output_tokens: {min: 10, max: 10}", "output_tokens: {min: 50, max: 50}").replace(
        "users: 4, think_time: {min: 20ms, max: 50ms}",
        "users: 8, arrival: {rate: 4, process: constant}")
    path.write_text(head + THIN.format(flap=flap))
    return path


def _journal(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "journal.json"
    return json.loads(path.read_text()) if path.exists() else []


def _claims(state_dir: Path) -> list[Any]:
    path = state_dir / "claims.json"
    return json.loads(path.read_text()) if path.exists() else []


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("flap", "fault_s", "said"), [
    ("{on: 0s, off: 2s}", "8s", "flap.on: must be at least 0.1s"),
    ("{on: 2s, off: {mean: 1s, min: 3s}}", "8s", "mean (1s) must lie between min and max"),
    ("{on: 2s, off: 2s, seed: 4}", "8s", "'on' and 'off' are both fixed here"),
    ("{on: 2s, off: 2s, start: sideways}", "8s", "flap.start"),
    ("{on: 8s, off: 1s}", "8s", "it would never switch; shorten flap.on"),
    ("{on: 1s, off: {mean: 10s, min: 9s, max: 20s}, start: off}", "8s",
     "it would never switch; shorten flap.off"),
])
def test_bad_flaps_are_refused_with_their_place(tmp_path: Path, flap: str, fault_s: str,
                                                said: str) -> None:
    path = _scenario(tmp_path, flap, fault_s)
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(path.read_text(), str(path))
    text = str(exc.value)
    assert said in text, text
    assert f"{path}:" in text, text     # located: file:line:col


def test_a_flap_longer_than_its_phase_is_a_warning(tmp_path: Path) -> None:
    path = _scenario(tmp_path, "{on: 3s, off: 4s}", "5s")
    scenario = parse_scenario(path.read_text(), str(path))
    (warning,) = [w for w in scenario_warnings(scenario) if "flaps" in w]
    assert "fault 'slow' flaps on 3s / off 4s, longer than its phase 'fault' (5s)" in warning


def test_the_dry_run_says_the_fault_flaps(tmp_path: Path) -> None:
    path = _scenario(tmp_path, "{on: {mean: 2s}, off: 3s, distribution: uniform}")
    proc = run_cli("run", str(path), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sse_proxy 'slow', flapping on ~2s / off ~3s (uniform)" in proc.stdout, proc.stdout


def test_a_seeded_random_pattern_is_the_same_every_time() -> None:
    flap = Flap.model_validate({"on": {"mean": "1s"}, "off": {"mean": "2s", "max": "3s"},
                                "distribution": "uniform", "seed": 7})
    first = flap.on_intervals(60.0, 0, "slow")
    assert first == flap.on_intervals(60.0, 0, "slow")     # the scenario's seed is overridden
    assert first == flap.on_intervals(60.0, 99, "slow")
    assert first != flap.on_intervals(60.0, 0, "other")    # two faults do not flap in lockstep
    unseeded = Flap.model_validate({"on": {"mean": "1s"}, "off": {"mean": "2s"}})
    assert unseeded.on_intervals(60.0, 3, "slow") == unseeded.on_intervals(60.0, 3, "slow")
    assert unseeded.on_intervals(60.0, 3, "slow") != unseeded.on_intervals(60.0, 4, "slow")
    # Random lengths, within their bounds, alternating, inside the window.
    lengths = [b - a for a, b in first]
    offs = [b[0] - a[1] for a, b in zip(first, first[1:], strict=False)]
    assert len(set(lengths)) > 3 and min(lengths) >= 0.1 - 1e-9
    assert all(0.1 - 1e-9 <= off <= 3.0 + 1e-9 for off in offs)
    assert first[0][0] == 0.0 and first[-1][1] <= 60.0


# -- a real run ----------------------------------------------------------------------------------


def _seconds_inside(intervals: list[tuple[float, float]]) -> set[int]:
    """Whole seconds of the timeline (from t0) that lie inside one of ``intervals``."""
    out = set()
    for a, b in intervals:
        out |= {i for i in range(int(a), int(b) + 1) if a <= i and i + 1 <= b}
    return out


@pytest.mark.timeout(120)
def test_a_flapping_fault_shows_its_pattern_per_second(tmp_path: Path, state_dir: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("run", str(_scenario(tmp_path, "{on: 2s, off: 2s}")), "--out", str(out),
                   "--no-watchdog", timeout=100)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    t0 = report["phases"][0]["start"]
    fault = next(p for p in report["phases"] if p["name"] == "fault")
    (record,) = report["faults"]
    edges = record["edges"]
    # on at the window's start, then off, on, off: each edge timed, none failed; the last
    # revert is the window's end, whatever the state.
    assert [e["state"] for e in edges] == ["on", "off", "on", "off"], edges
    assert all(e["error"] is None and e["took_ms"] is not None for e in edges), edges
    assert edges[0]["at"] >= fault["start"] and edges[-1]["at"] >= edges[-2]["at"]
    assert record["error"] is None
    # Each on-state was its own journal entry and claim, all gone now.
    assert _journal(state_dir) == [] and _claims(state_dir) == []

    cuts = [e["at"] - t0 for e in edges]
    ons = [(cuts[0], cuts[1]), (cuts[2], cuts[3])]
    offs = [(cuts[1], cuts[2]), (cuts[3], fault["end"] - t0)]
    on_s, off_s = _seconds_inside(ons), _seconds_inside(offs)
    assert len(on_s) >= 2 and len(off_s) >= 2, (ons, offs)
    ttft = {int(s["t"]): s["p50"]["ttft_ms"] for s in report["timeline"]}
    on_ttft = [ttft[i] for i in sorted(on_s) if ttft.get(i) is not None]
    off_ttft = [ttft[i] for i in sorted(off_s) if ttft.get(i) is not None]
    baseline = [s["p50"]["ttft_ms"] for s in report["timeline"] if s["phase"] == "baseline"]
    # The pattern: every second inside an on-state is slower than every one inside an off-state
    # by most of the 300 ms delay, and the off-seconds are like the baseline's.
    assert min(on_ttft) > max(off_ttft) + 150, (on_ttft, off_ttft)
    assert statistics.median(off_ttft) < statistics.median(baseline) + 100, (off_ttft, baseline)

    # The phase's measurements, split by the state they were due in.
    on, off = record["states"]["on"], record["states"]["off"]
    assert on["requests"] > 0 and off["requests"] > 0
    assert on["ttft_ms"]["p50"] > off["ttft_ms"]["p50"] + 150
    assert on["sent"] + off["sent"] == fault["stats"]["sent"]
    assert on["seconds"] + off["seconds"] == pytest.approx(fault["end"] - fault["start"])
    # Drawn and told: a band per on-state, a line in each summary.
    html = (out / "report.html").read_text()
    assert html.count("<title>slow on</title>") >= 2 * 2      # two on-states, on every chart
    assert "flapped on 2 times" in proc.stdout
    assert "flapped on 2 times" in (out / "summary.md").read_text()




@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["proxy", pytest.param("tbf", marks=needs_root)])
def test_a_run_killed_while_flapping_on_is_recovered(kind: str, tmp_path: Path, state_dir: Path,
                                                     reaper: None) -> None:
    scenario = (_scenario if kind == "proxy" else _tbf_scenario)(
        tmp_path, "{on: 1s, off: 1s}", "60s", name="kill-flap")
    name, fault_type = ("slow", "sse_proxy") if kind == "proxy" else ("thin", "tbf")
    proc = subprocess.Popen(cli_cmd("run", str(scenario), "--out", str(tmp_path / "out"),
                                    "--no-watchdog"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    # The second on-edge: it was applied, reverted, and applied again under a new entry.
    seen = wait_for_line(proc, "fault applied", 2, timeout_s=90)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert any("fault reverted" in s for s in seen), "".join(seen)
    left = _journal(state_dir)
    assert [e["name"] for e in left if e["type"] == fault_type] == [name], left
    done = run_cli("recover", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert name in done.stdout, done.stdout
    assert _journal(state_dir) == [] and _claims(state_dir) == []
    # The run's own namespace and host link (its qdiscs with them) are gone; by name, as other
    # runs on this machine may make and remove theirs meanwhile.
    mine = {e["name"] for e in left if str(e["name"]).startswith("sq-")}
    mine |= {"sqh" + n.removeprefix("sq-") for n in mine}
    assert mine or kind == "proxy", left
    assert not mine & _ours_in_kernel(), mine


@needs_root
@pytest.mark.timeout(180)
def test_a_flapping_tbf_shows_its_pattern_and_leaves_nothing(tmp_path: Path,
                                                            state_dir: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("run", str(_tbf_scenario(tmp_path, "{on: 3s, off: 3s}", "12s")), "--out",
                   str(out), "--no-watchdog", timeout=160)
    assert_run_ok(proc, out)
    report = json.loads((out / "report.json").read_text())
    t0 = report["phases"][0]["start"]
    fault = next(p for p in report["phases"] if p["name"] == "fault")
    (record,) = report["faults"]
    edges = record["edges"]
    assert [e["state"] for e in edges] == ["on", "off", "on", "off"], edges
    assert all(e["error"] is None for e in edges) and record["error"] is None
    cuts = [e["at"] - t0 for e in edges]
    # The requests sent in each state, by when they went out: an arrival due in an on-state
    # may wait for a slot (eight streams held by the thin pipe) and go out after the revert,
    # quick, so the seconds they were due in need not look slow (CI: an on-state's seconds
    # read 309 ms at p50, its arrivals queued past the revert).
    with open(out / "samples.csv", newline="") as f:
        sent = [(float(r["sent_epoch_s"]) - t0, float(r["e2e_ms"])) for r in csv.DictReader(f)
                if r["error"] == "" and r["e2e_ms"]]
    offs = [(cuts[1], cuts[2]), (cuts[3], fault["end"] - t0)]
    off_e2e = [e for t, e in sent if any(a <= t < b for a, b in offs)]
    assert len(off_e2e) >= 3, (offs, sent)
    # Each on-state shows in the requests sent inside it; against the off-state's median, since
    # a connection whose packets the thin pipe dropped may still be in TCP's retransmission
    # back-off a second after the revert (a real after-effect).
    for a, b in ((cuts[0], cuts[1]), (cuts[2], cuts[3])):
        on_e2e = [e for t, e in sent if a <= t < b]
        assert on_e2e and max(on_e2e) > 3 * statistics.median(off_e2e), (a, b, on_e2e, off_e2e)
    on, off = record["states"]["on"], record["states"]["off"]
    if on["e2e_ms"]["p50"] is not None:
        assert on["e2e_ms"]["p50"] > 2 * off["e2e_ms"]["p50"], (on["e2e_ms"], off["e2e_ms"])
    else:
        # A pipe that thin can hold every stream sent in an on-state past its end (a busy
        # host): none ended inside it, each counted as spanning the edge, unlike the off-state.
        assert on["unattributed"]["e2e_ms"] > off["unattributed"]["e2e_ms"], (on, off)
        assert off["e2e_ms"]["p50"] is not None, off
    assert _journal(state_dir) == [] and _claims(state_dir) == []
