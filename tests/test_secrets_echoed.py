"""A key quoted in part or transformed (OpenAI's 401 quotes its first 12 and last 4
characters; a target may upper-case, reverse, base64- or percent-encode it), and credentials
written in ``target.url`` (``http://user:KEY@host``): none reaches an artifact (issue 37, 1).
"""

from __future__ import annotations

import base64
import random
import secrets
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.plan import LoadPlan, RequestClassPlan
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.templates import REDACTED, Redactor
from tests.conftest import REPO, cli_cmd


def measure_echo(url: str, path: str, env: dict[str, str]) -> RequestSample:
    plan = LoadPlan(base_url=url, protocol="sse", samples_path="/x", end_at=0.0,
                    timeout_s=5.0, path=path, headers={"Authorization": "Bearer ${SQ_CANARY_KEY}"})
    client = StreamClient(plan, environ=env)
    try:
        return client.measure(RequestClassPlan(), random.Random(0))
    finally:
        client.close()


def canaries() -> dict[str, str]:
    return {"SQ_CANARY_KEY": f"sk-canary-{secrets.token_hex(12)}"}


@pytest.mark.timeout(10)
def test_redactor_removes_any_run_of_a_secret_and_its_transforms() -> None:
    key = "sk-proj-Q7vX9aLmZ2rT4wYb8NcE+/=k"
    redact = Redactor.for_request({"Authorization": "Bearer ${K}"},
                                  {"Authorization": f"Bearer {key}"}, "", "", {"K": key})
    echoes = {
        "prefix": key[:12], "middle": key[9:17], "upper": key.upper(), "lower": key.lower(),
        "reversed": key[::-1], "base64": base64.b64encode(key.encode()).decode(),
        "base64-part": base64.b64encode(key[5:20].encode()).decode(),
        "urlsafe": base64.urlsafe_b64encode(key.encode()).decode(),
        "percent": urllib.parse.quote(key, safe=""), "plus": urllib.parse.quote_plus(key),
    }
    for how, echo in echoes.items():
        out = redact(f"Incorrect API key provided: {echo}******** (code 401)")
        assert REDACTED in out, (how, out)
        # No run of 6 characters of any form is left.
        assert not any(echo[i:i + 6] in out for i in range(len(echo) - 5)), (how, out)
        assert out.startswith("Incorrect API key provided: ") and out.endswith("(code 401)")
    # Words are not secrets: "Bearer" is the scheme, and short runs stay.
    assert redact("Bearer token invalid; ends in " + key[-4:]) == (
        "Bearer token invalid; ends in " + key[-4:])


@pytest.mark.timeout(10)
def test_a_basic_token_redacts_the_password_it_holds() -> None:
    token = base64.b64encode(b"alice:pw-Zq81LmXo").decode()
    redact = Redactor.for_request({"Authorization": f"Basic {token}"},
                                  {"Authorization": f"Basic {token}"}, "", "", {})
    assert redact("bad password pw-Zq81LmXo for alice") == f"bad password {REDACTED} for alice"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["prefix", "upper", "reversed", "base64", "percent", "middle"])
def test_the_client_redacts_a_key_quoted_in_part(echo_server: str, how: str) -> None:
    env = canaries()
    sample = measure_echo(echo_server, f"/echo-key-part?how={how}", env)
    assert sample.error == "http_status", sample.error_detail
    detail = sample.error_detail or ""
    assert REDACTED in detail, detail
    key = env["SQ_CANARY_KEY"]
    forms = [key, key.upper(), key[::-1], base64.b64encode(key.encode()).decode()]
    assert not any(f[i:i + 6] in detail for f in forms for i in range(len(f) - 5)), detail


def test_credentials_in_the_url_leave_it_for_a_basic_header() -> None:
    from streamquake.scenario.schema import TargetSpec
    spec = TargetSpec.model_validate(
        {"protocol": "openai", "url": "http://alice:sk%2Dsecret-Url42@127.0.0.1:8000/v1"})
    assert spec.url == "http://127.0.0.1:8000/v1"
    assert spec.headers == {
        "Authorization": "Basic " + base64.b64encode(b"alice:sk-secret-Url42").decode()}
    with pytest.raises(ValueError, match="give them once"):
        TargetSpec.model_validate({"protocol": "openai", "url": "http://a:b@h:1",
                                   "headers": {"authorization": "Bearer x"}})


URL_SCENARIO = """\
name: canary-url
target:
  protocol: sse
  url: "{url}"
  path: "/echo-part-mixed"
  probe: false
  timeout: 3s
load: {{users: 3, spawn_rate: 100, think_time: {{min: 10ms, max: 50ms}}}}
phases: {{baseline: 2s, fault: 2s, recovery: 2s}}
faults:
  - {{type: sse_proxy, phase: fault, delay: 1ms}}
"""


@pytest.mark.timeout(180)
def test_no_artifact_holds_url_credentials_or_a_key_quoted_in_part(
        echo_server: str, tmp_path: Path, state_dir: Path) -> None:
    """``http://user:KEY@host``, whose KEY the target (as Basic credentials) quotes back in
    part and transformed: neither the URL's credentials nor any 6-character run of the key is
    in the dry run, the reports, the load plan, the samples or the logs."""
    key = f"sq-urlkey-{secrets.token_hex(12)}"
    host = echo_server.removeprefix("http://")
    scenario = tmp_path / "canary.yaml"
    scenario.write_text(URL_SCENARIO.format(url=f"http://sq:{key}@{host}"))
    token = base64.b64encode(f"sq:{key}".encode()).decode()
    # What the target quotes is the Authorization token, in part and transformed.
    forms = [token, token.upper(), token[::-1], key]
    needles = {f[i:i + 8].encode() for f in forms for i in range(0, len(f) - 7, 4)}
    dry = subprocess.run(cli_cmd("run", str(scenario), "--dry-run"), capture_output=True,
                         timeout=60, cwd=REPO)
    assert dry.returncode == 0, dry.stderr.decode()
    assert host.encode() in dry.stdout
    assert not any(n in dry.stdout + dry.stderr for n in needles)
    out = tmp_path / "out"
    proc = subprocess.run(cli_cmd("run", str(scenario), "--out", str(out)),
                          capture_output=True, timeout=170, cwd=REPO)
    assert proc.returncode in (0, 1, 6), proc.stderr.decode()[-2000:]
    files = [p for root in (out, state_dir) if root.exists() for p in root.rglob("*")
             if p.is_file()]
    names = {p.name for p in files}
    assert {"report.json", "report.html", "junit.xml", "summary.md"} <= names, names
    # The load plan too: the Basic header the URL's credentials became is lifted into the
    # load process's environment, the plan names a variable.
    leaks = [str(p) for p in files if any(n in p.read_bytes() for n in needles)]
    assert leaks == []
    plan = (out / "run" / "load-plan.json").read_text()
    assert '"Authorization": "${STREAMQUAKE_LITERAL_SECRET_0}"' in plan, plan
    assert not any(n in proc.stdout + proc.stderr for n in needles)
    samples = b"".join(p.read_bytes() for p in files if p.name.startswith("samples-"))
    assert samples.count(REDACTED.encode()) >= 3, samples[:2000]


def test_literal_credentials_are_lifted_out_of_the_plan_and_templates_stay() -> None:
    from streamquake.loadgen.plan import lift_literal_secrets
    from streamquake.loadgen.templates import expand_headers, expand_path

    plan = LoadPlan(base_url="http://127.0.0.1:1", protocol="gemini", samples_path="/x",
                    end_at=0.0, path="/v1/m:streamGenerateContent?alt=sse&key=AIzaLiteral123",
                    headers={"Authorization": "Bearer sk-literal-9f3", "X-Api-Key": "${K}",
                             "X-Trace": "plain-value"})
    lifted, env = lift_literal_secrets(plan)
    text = lifted.model_dump_json()
    assert "sk-literal-9f3" not in text and "AIzaLiteral123" not in text, text
    assert sorted(env.values()) == ["AIzaLiteral123", "Bearer sk-literal-9f3"]
    # A ${VAR} header and a header that is no credential stay as written.
    assert lifted.headers["X-Api-Key"] == "${K}" and lifted.headers["X-Trace"] == "plain-value"
    # What the load process sends is unchanged.
    environ = {**env, "K": "k-from-env"}
    assert expand_headers(lifted.headers, environ) == expand_headers(plan.headers, environ)
    assert expand_path(lifted.path or "", environ) == plan.path
    # Nothing to lift: the same plan.
    assert lift_literal_secrets(lifted) == (lifted, {})
