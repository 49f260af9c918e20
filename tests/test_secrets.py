"""Credentials never reach an artifact: a canary key, given as a header and as Gemini's
``key=`` query parameter, and echoed back by the target in every way it can (an error body, an
error event, a redirect), is found in no file of a real run, nor on any command line.
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
import threading
from pathlib import Path

import pytest

from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.templates import REDACTED, Redactor
from tests.conftest import REPO, cli_cmd
from tests.helpers import assert_run_ok


def measure_echo(url: str, path: str, env: dict[str, str]) -> RequestSample:
    """One request to the hostile server's ``path``, the canaries in its header and query."""
    plan = LoadPlan(base_url=url, protocol="sse", samples_path="/x", end_at=0.0,
                    timeout_s=5.0, path=f"{path}?alt=sse&key=${{SQ_CANARY_QKEY}}",
                    headers={"Authorization": "Bearer ${SQ_CANARY_KEY}"})
    client = StreamClient(plan, environ=env)
    try:
        return client.measure(RequestClassPlan(), random.Random(0))
    finally:
        client.close()


def canaries() -> dict[str, str]:
    return {"SQ_CANARY_KEY": f"sk-canary-{secrets.token_hex(12)}",
            "SQ_CANARY_QKEY": f"AIzaCanary{secrets.token_hex(12)}"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/echo-key", "/echo-key-event", "/echo-key-redirect"])
def test_the_client_redacts_what_the_target_echoes(echo_server: str, path: str) -> None:
    env = canaries()
    sample = measure_echo(echo_server, path, env)
    expected = "stream_error" if path == "/echo-key-event" else "http_status"
    assert sample.error == expected, sample.error_detail
    detail = sample.error_detail or ""
    assert REDACTED in detail, detail          # the target did echo something
    assert not any(v in sample.to_json() for v in env.values()), detail


@pytest.mark.timeout(10)
def test_redactor_rules() -> None:
    env = {"TOKEN": "tok-123456789", "SHORT": "abc"}
    redact = Redactor.for_request(
        {"Authorization": "Bearer ${TOKEN}", "X-Api-Key": "literal-key-42", "Accept": "text/x",
         "X-Short": "${SHORT}"},
        {"Authorization": "Bearer tok-123456789", "X-Api-Key": "literal-key-42",
         "Accept": "text/x", "X-Short": "abc"},
        "/v1?key=${QK}", "/v1?key=query-secret-1", {**env, "QK": "query-secret-1"})
    text = ("Bearer tok-123456789 / literal-key-42 / query-secret-1 / text/x / abc / "
            "https://x/?api_key=other-made-up-1&next=1")
    assert redact(text) == (f"{REDACTED} / {REDACTED} / {REDACTED} / text/x / abc / "
                            f"https://x/?api_key={REDACTED}&next=1")


SCENARIO = """\
name: canary
target:
  protocol: sse
  url: "{url}"
  path: "/echo-mixed?alt=sse&key=${{SQ_CANARY_QKEY}}"
  headers: {{Authorization: "Bearer ${{SQ_CANARY_KEY}}", x-goog-api-key: "${{SQ_CANARY_QKEY}}"}}
  timeout: 3s
load: {{users: 3, spawn_rate: 100, think_time: {{min: 10ms, max: 50ms}}}}
phases: {{baseline: 3s, fault: 3s, recovery: 2s}}
faults:
  - {{type: sse_proxy, phase: fault, delay: 1ms}}
"""


class CommandLines(threading.Thread):
    """Reads every process's command line while the run goes on, looking for the canaries."""

    def __init__(self, needles: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.needles = needles
        self.done = threading.Event()
        self.seen: list[str] = []
        self.scans = 0

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.scans += 1
            for proc in Path("/proc").iterdir():
                try:
                    cmdline = (proc / "cmdline").read_bytes()
                except OSError:
                    continue
                if any(n in cmdline for n in self.needles):
                    self.seen.append(cmdline.decode(errors="replace"))


@pytest.mark.timeout(180)
def test_no_artifact_of_a_run_holds_the_key(echo_server: str, tmp_path: Path,
                                            state_dir: Path) -> None:
    env = canaries()
    needles = [v.encode() for v in env.values()]
    scenario = tmp_path / "canary.yaml"
    scenario.write_text(SCENARIO.format(url=echo_server))
    out = tmp_path / "out"
    watcher = CommandLines(needles)
    watcher.start()
    try:
        proc = subprocess.run(cli_cmd("run", str(scenario), "--out", str(out)),
                              capture_output=True, timeout=170, cwd=REPO,
                              env={**os.environ, **env})
    finally:
        watcher.done.set()
        watcher.join()
    assert_run_ok(proc, out)
    assert watcher.scans > 10 and watcher.seen == []
    files = [p for root in (out, state_dir) if root.exists() for p in root.rglob("*")
             if p.is_file()]
    names = {p.name for p in files}
    assert {"report.json", "junit.xml", "summary.md", "locust.log"} <= names, names
    assert any(n.startswith("samples-") for n in names), names
    leaks = [str(p) for p in files if any(n in p.read_bytes() for n in needles)]
    assert leaks == []
    assert not any(n in proc.stdout + proc.stderr for n in needles)
    # Not vacuous: the target did echo the key, and what it echoed was redacted.
    samples = b"".join(p.read_bytes() for p in files if p.name.startswith("samples-"))
    assert samples.count(REDACTED.encode()) >= 3, samples[:2000]
    print(f"\ncanary run: {len(files)} files checked ({', '.join(sorted(names))}), "
          f"{watcher.scans} scans of every command line")
