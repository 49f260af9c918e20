"""Issue 37.6: a run's private SSE proxy takes faults only from that run.

A fault put into it by anyone else (`inject sse_proxy ... --proxy <the run's proxy>`, a PUT on
its control API) is refused with a sentence (403), so the run's verdicts never blame the target
for a fault it did not make; the run's own injector (holding the proxy's key) applies, reverts
and recovers as before. A standing proxy (`streamquake proxy`) still takes anyone's.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.faults.contract import RunContext
from streamquake.faults.proxy.injector import SSEProxyInjector
from streamquake.faults.proxy.resources import FaultProxy
from streamquake.faults.proxy.server import ProxyProcess, start_proxy
from streamquake.faults.proxy.spec import SSEProxyFault
from streamquake.journal import Journal
from tests.conftest import run_cli
from tests.test_agent import local_agent_stopped

__all__ = ["local_agent_stopped"]     # the fixture, used by name below


@pytest.fixture(scope="module")
def target() -> Iterator[TargetProcess]:
    cfg = TargetConfig.model_validate({"ttft": "5ms", "itl": "0ms",
                                       "output_tokens": {"min": 8, "max": 8}})
    with start_target(cfg) as t:
        yield t


def _control(p: ProxyProcess, method: str, path: str, body: Any = None,
             key: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(p.control_url + path, data=data, method=method)
    if key is not None:
        req.add_header("Streamquake-Proxy-Key", key)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("local_agent_stopped")
def test_a_private_proxy_refuses_faults_from_anyone_but_its_run(
        target: TargetProcess, tmp_path: Path, state_dir: Path) -> None:
    with start_proxy(target.url, private=True) as p:
        assert p.key
        for method, body, key in (("PUT", {"drop": 0.6}, None), ("PUT", {"drop": 0.6}, "x" * 32),
                                  ("DELETE", None, None)):
            status, answer = _control(p, method, "/faults/foreign", body, key)
            assert status == 403, answer
            assert answer["error"].startswith("this SSE proxy is a run's own"), answer
        assert _control(p, "GET", "/faults") == (200, {"faults": {}})

        # The run's own injector holds the key: apply, revert, recover as ever.
        resource = FaultProxy.attached(p.control_url)
        resource.control_key = p.key
        inj = SSEProxyInjector(SSEProxyFault.model_validate(
            {"type": "sse_proxy", "name": "mine", "drop": "50%"}),
            RunContext("127.0.0.1", 0, tmp_path, resources=[resource]))
        journal = Journal(tmp_path / "journal.json")
        entry = journal.add("sse_proxy", "mine")
        inj.apply(entry)
        assert _control(p, "GET", "/faults")[1] == {"faults": {"mine": {"drop": 0.5}}}
        state = journal.entries()[0]["state"]
        assert isinstance(state, dict)
        assert "removed fault 'mine'" in SSEProxyInjector.recover(state)
        entry.done()    # the run's fault is over (as in its recovery step): the proxy is free
        assert _control(p, "GET", "/faults") == (200, {"faults": {}})

        # By hand, through the local agent, as the issue did: refused, one sentence, exit 3.
        address = p.url.split("://", 1)[1]
        done = run_cli("inject", "sse_proxy", "drop=60%", "--proxy", address, "--for", "5s",
                       timeout=60)
        assert done.returncode == 3, done.stdout + done.stderr
        assert "this SSE proxy is a run's own" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert _control(p, "GET", "/faults") == (200, {"faults": {}})


@pytest.mark.timeout(30)
def test_a_standing_proxy_takes_anyones_faults(target: TargetProcess) -> None:
    with start_proxy(target.url) as p:
        assert p.key is None
        assert _control(p, "PUT", "/faults/any", {"drop": 0.1})[0] == 200
        assert _control(p, "DELETE", "/faults/any")[0] == 200
