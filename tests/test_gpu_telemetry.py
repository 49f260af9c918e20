"""GPU telemetry, GPU discovery and the target's slowdown factor, against the emulated driver."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from nvml_shim import FakeGpus, run_python


@pytest.fixture
def gpus(tmp_path: Path) -> FakeGpus:
    return FakeGpus(tmp_path / "gpus.txt", gpu_count=2)


def by_gpu(samples: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        out[s["gpu"]].append(s)
    return out


# Child processes wait for what they need by polling (``WAIT``), up to a deadline that only a
# hang reaches, instead of sleeping a fixed time and counting what came.
WAIT = """
import time
def wait(what, cond, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not within %g s: %s" % (timeout_s, what)
        time.sleep(0.02)
def count(s, gpu, since=None):
    return sum(1 for x in s.samples() if x["gpu"] == gpu and (since is None or x["t"] > since))
"""


@pytest.mark.timeout(90)
def test_sampler_takes_one_sample_per_second_per_gpu(gpus: FakeGpus) -> None:
    # GPU 0 idles; GPU 1 is clock-locked and wants more power than its limit allows.
    gpus.update({"gpu0.util_gpu": 0, "gpu1.sm_lock": "500,800", "gpu1.power_mw": 300000,
                 "gpu1.power_draw_mw": 420000, "gpu1.util_gpu": 97, "gpu1.mem_used_mib": 40960})
    code = WAIT + """
import json
from streamquake.faults.gpu.telemetry import GpuSampler
assert GpuSampler.available()
s = GpuSampler()  # the default interval: 1 s
s.start()
wait("4 samples of each GPU", lambda: min(count(s, 0), count(s, 1)) >= 4)
samples = s.stop()
print(json.dumps({"samples": samples, "again": s.stop() == samples, "error": s.error}))
"""
    out = run_python(code, gpus.env(), timeout=80)
    assert out["error"] is None and out["again"] is True
    per_gpu = by_gpu(out["samples"])
    assert sorted(per_gpu) == [0, 1]
    for samples in per_gpu.values():
        assert len(samples) >= 4
        # Scheduled from the sampler's start: tick k is never early, so never more than one
        # sample a second, and a late tick (a busy machine) does not push the later ones back
        # (the next comes at once). A slower interval makes every tick later than the one before
        # (1.3 s: the middle one 0.6 s late); a busy machine makes one or two late, not most.
        offsets = [s["t"] - samples[0]["t"] for s in samples]
        assert all(at >= k - 0.05 for k, at in enumerate(offsets)), offsets
        late = sorted(at - k for k, at in enumerate(offsets))
        assert late[len(late) // 2] < 0.5, offsets       # most ticks nearer their own second
    idle, locked = per_gpu[0][-1], per_gpu[1][-1]
    assert idle["clock_event_reasons"] == ["gpu_idle"]
    assert idle["sm_clock_mhz"] == 1980 and idle["util_gpu_pct"] == 0
    assert locked["clock_event_reasons"] == ["applications_clocks_setting", "sw_power_cap"]
    assert locked["sm_clock_mhz"] == 795
    assert locked["power_w"] == 300.0
    assert locked["mem_used_mib"] == 40960
    assert locked["util_gpu_pct"] == 97 and locked["util_mem_pct"] == 12
    assert locked["temperature_c"] == 45 and locked["mem_clock_mhz"] == 2619
    assert locked["uuid"] == "GPU-fa4e0000-5eed-4c1a-9e57-000000000001"


@pytest.mark.timeout(90)
def test_a_gpu_lost_mid_run_is_recorded_not_fatal(gpus: FakeGpus) -> None:
    code = WAIT + f"""
import json
from streamquake.faults.gpu.telemetry import GpuSampler
s = GpuSampler(interval_s=0.2)
s.start()
wait("2 samples of GPU 1", lambda: count(s, 1) >= 2)
before = s.samples()          # each read whole before the GPU is lost
# The "hardware" event: the emulated GPU 1 falls off the bus.
with open({str(gpus.path)!r}, "a") as f:
    f.write("gpu1.lost=1\\n")
lost_at = time.time()         # every sample stamped later is read after the loss
wait("3 samples of each GPU after the loss",
     lambda: min(count(s, 0, lost_at), count(s, 1, lost_at)) >= 3)
samples = s.stop()
print(json.dumps({{"samples": samples, "before": before, "lost_at": lost_at, "error": s.error,
                   "alive": s._thread.is_alive()}}))
"""
    out = run_python(code, gpus.env(), timeout=80)
    assert out["error"] is None and out["alive"] is False
    per_gpu = by_gpu(out["samples"])
    healthy = per_gpu[0]
    assert sum(s["t"] > out["lost_at"] for s in healthy) >= 3     # GPU 0 went on
    assert all("error" not in s for s in healthy)
    before = by_gpu(out["before"])[1]
    after = [s for s in per_gpu[1] if s["t"] > out["lost_at"]]
    assert before and all(s["sm_clock_mhz"] == 1980 for s in before)
    assert len(after) >= 3
    for s in after:
        assert "fell off the bus (NVML_ERROR_GPU_IS_LOST)" in s["error"]
        assert "sm_clock_mhz" not in s
    # Healthy until the loss, lost from then on (a sample stamped just before the write may
    # have been read just after it).
    states = ["error" in s for s in per_gpu[1]]
    assert states == sorted(states), states


@pytest.mark.timeout(30)
def test_describe_gpus_is_read_only_discovery(gpus: FakeGpus) -> None:
    gpus.update({"gpu1.name": "NVIDIA A100-SXM4-80GB", "gpu1.arch": 7, "gpu1.max_sm_mhz": 1410,
                 "gpu1.mem_clocks": "1593,1215", "gpu1.default_power_mw": 400000})
    before = gpus.text()
    code = """
import json
from streamquake.faults.gpu.telemetry import describe_gpus
print(json.dumps(describe_gpus()))
"""
    described = run_python(code, gpus.env())
    assert gpus.text() == before
    assert [d["index"] for d in described] == [0, 1]
    a100 = described[1]
    assert a100["name"] == "NVIDIA A100-SXM4-80GB" and a100["architecture"] == "Ampere"
    assert a100["uuid"] == "GPU-fa4e0000-5eed-4c1a-9e57-000000000001"
    assert a100["max_sm_clock_mhz"] == 1410 and a100["max_mem_clock_mhz"] == 1593
    assert a100["supported_sm_clocks_mhz"] == {"min": 345, "max": 1410}
    assert a100["supported_mem_clocks_mhz"] == [1593, 1215]
    assert a100["power_limit_w"] == {"default": 400.0, "min": 200.0, "max": 700.0}
    assert a100["emulated"] is True and a100["driver"].startswith("550.")


@pytest.mark.timeout(90)
def test_slowdown_factor_follows_the_clock_at_most_every_200ms(gpus: FakeGpus) -> None:
    # A change right after a read is not seen for 200 ms: shown only by an attempt whose two
    # calls both fell within 200 ms (timed around them), which a busy machine may take a few
    # tries to give. Waiting 300 ms is enough for the next call to read again, however busy.
    code = f"""
import json, time
from streamquake.embedded.gpu_speed import slowdown_factor
path = {str(gpus.path)!r}
def put(line):
    with open(path, "a") as f:
        f.write(line + "\\n")
first = slowdown_factor()
locks = [("990,990", 2.0), ("1980,1980", 1.0)]
deadline = time.monotonic() + 60
tries = 0
while True:
    lock, factor = locks[tries % 2]
    time.sleep(0.3)                    # the cached reading has expired: the next call reads
    t0 = time.monotonic()
    fresh = slowdown_factor()
    put("gpu0.sm_lock=" + lock)
    cached = slowdown_factor()         # still the reading of t0 or later
    if time.monotonic() - t0 < 0.2:
        break
    tries += 1
    assert time.monotonic() < deadline, "no two calls within 200 ms in 60 s"
time.sleep(0.3)
seen = [first, fresh, cached, factor, slowdown_factor()]
put("gpu0.sm_lock=1485,1485")
time.sleep(0.3)
seen.append(slowdown_factor())
put("gpu0.lost=1")
time.sleep(0.3)
seen.append(slowdown_factor())
print(json.dumps(seen))
"""
    first, fresh, cached, factor, after, relocked, lost = run_python(code, gpus.env(), timeout=80)
    assert first == 1.0
    assert cached == fresh and after == factor != fresh
    assert (relocked, lost) == (pytest.approx(1980 / 1485), 1.0)


@pytest.mark.timeout(90)
def test_sampler_sees_a_fault_applied_in_the_same_process(gpus: FakeGpus, tmp_path: Path) -> None:
    # The runner's arrangement: the sampler thread reads while the main thread applies/reverts.
    # "before" and "during" are the samples taken whole before the apply and before the revert
    # began; "after", those stamped once the revert was done.
    code = WAIT + """
import json
from pathlib import Path
from streamquake.faults.gpu.telemetry import GpuSampler
from streamquake.faults.contract import RunContext
from streamquake.faults.gpu.clocks import GpuClocksFault, GpuClocksInjector
from streamquake.journal import Journal
spec = GpuClocksFault(sm_clocks_mhz=(990, 990), power_limit_w=300)
inj = GpuClocksInjector(spec, RunContext("127.0.0.1", 1, Path(".")))
s = GpuSampler(interval_s=0.1)
def each_gpu_since(t):
    wait("a sample of each GPU", lambda: min(count(s, 0, t), count(s, 1, t)) >= 1)
s.start()
each_gpu_since(None)
before = s.samples()
entry = Journal().add("gpu_clocks", "t")
inj.apply(entry); applied = time.time()
each_gpu_since(applied)
during = [x for x in s.samples() if x["t"] > applied]
inj.revert(); entry.done(); reverted = time.time()
each_gpu_since(reverted)
print(json.dumps({"before": before, "during": during, "samples": s.stop(),
                  "reverted": reverted, "error": s.error}))
"""
    out = run_python(code, gpus.env(STREAMQUAKE_STATE_DIR=str(tmp_path / "state")), timeout=80)
    assert out["error"] is None
    for gpu, samples in by_gpu(out["samples"]).items():
        before, during = by_gpu(out["before"])[gpu], by_gpu(out["during"])[gpu]
        after = [s for s in samples if s["t"] > out["reverted"]]
        assert before and during and after
        assert all(s["sm_clock_mhz"] == 1980 and s["power_w"] == 350.0 for s in before)
        assert all(s["sm_clock_mhz"] == 990 and s["power_w"] == 300.0 for s in during)
        assert all("applications_clocks_setting" in s["clock_event_reasons"] for s in during)
        assert all(s["sm_clock_mhz"] == 1980 and s["clock_event_reasons"] == [] for s in after)
