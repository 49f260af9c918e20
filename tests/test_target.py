"""The embedded target, as a real process on loopback, decoded from raw bytes on the wire."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from streamquake import procs, protocols
from streamquake.embedded.config import TargetConfig
from streamquake.embedded.formats import VOCABULARY
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.embedded.timing import DelaySampler, plan_response, request_rng, sample_ms
from streamquake.errors import TargetError
from tests.helpers import read_send_log, token_sent_ns

FAST = {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 4, "max": 8}, "seed": 7,
        "sse_event_ids": True}

OPENAI = "/v1/chat/completions"
ANTHROPIC = "/v1/messages"
GEMINI = "/v1beta/models/gemini-test:streamGenerateContent?alt=sse"
GENERIC = "/v1/stream"


def openai_body(**extra: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "say three words"}]
    return {"model": "m", "messages": msgs, "stream": True, **extra}


def anthropic_body(**extra: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "say three words"}]}]
    return {"model": "m", "max_tokens": 100, "messages": msgs, "stream": True, **extra}


def gemini_body(**config: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": "say three words"}]}]}
    if config:
        body["generationConfig"] = config
    return body


def generic_body(**extra: Any) -> dict[str, Any]:
    return {"prompt": "say three words", **extra}


# --- a minimal SSE client that timestamps every event -------------------------------------------


@dataclass
class Event:
    at: float  # monotonic seconds when its last byte arrived
    fields: dict[str, str]

    @property
    def data(self) -> Any:
        raw = self.fields["data"]
        return raw if raw == "[DONE]" else json.loads(raw)


@dataclass
class Reply:
    status: int
    sent: float
    raw: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.raw)


def _split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    blocks = []
    while True:
        cuts = [(buf.find(sep), sep) for sep in (b"\r\n\r\n", b"\n\n") if buf.find(sep) >= 0]
        if not cuts:
            return blocks, buf
        pos, sep = min(cuts)
        blocks.append(buf[:pos])
        buf = buf[pos + len(sep) :]


def _parse_block(block: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in block.decode().splitlines():
        name, _, value = line.partition(":")
        out[name] = value[1:] if value.startswith(" ") else value
    return out


async def _fetch(
    url: str,
    body: Any,
    headers: dict[str, str] | None,
    ssl_ctx: ssl.SSLContext | None,
    hang_up_after: int | None,
) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        sent = time.monotonic()
        async with session.post(url, data=data, headers=headers, ssl=ssl_ctx) as resp:
            reply = Reply(status=resp.status, sent=sent, headers=dict(resp.headers))
            buf = b""
            async for chunk in resp.content.iter_any():
                now = time.monotonic()
                reply.raw += chunk
                blocks, buf = _split_events(buf + chunk)
                reply.events += [Event(now, _parse_block(b)) for b in blocks]
                if hang_up_after is not None and len(reply.events) >= hang_up_after:
                    resp.close()
                    break
    return reply


def post(
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
    ssl_ctx: ssl.SSLContext | None = None,
    hang_up_after: int | None = None,
) -> Reply:
    return asyncio.run(_fetch(url, body, headers, ssl_ctx, hang_up_after))


def post_many(url: str, bodies: list[Any]) -> list[Reply]:
    async def go() -> list[Reply]:
        return list(await asyncio.gather(*(_fetch(url, b, None, None, None) for b in bodies)))

    return asyncio.run(go())


def get(url: str) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            return resp.status, await resp.read()

    return asyncio.run(go())


def content_events(reply: Reply, text_of: Any) -> list[tuple[Event, str]]:
    out = []
    for ev in reply.events:
        if ev.fields.get("data", "[DONE]") == "[DONE]":
            continue
        text = text_of(ev.data)
        if text:
            out.append((ev, text))
    return out


def openai_text(d: Any) -> str | None:
    return d["choices"][0]["delta"].get("content") if d.get("choices") else None


def anthropic_text(d: Any) -> str | None:
    return d["delta"]["text"] if d["type"] == "content_block_delta" else None


def gemini_text(d: Any) -> str | None:
    return "".join(p.get("text", "") for p in d["candidates"][0]["content"]["parts"])


def generic_text(d: Any) -> str | None:
    return d.get("text")


def assert_ids_consecutive(reply: Reply) -> None:
    assert [int(ev.fields["id"]) for ev in reply.events] == list(range(1, len(reply.events) + 1))


def assert_one_word_each(pairs: list[tuple[Event, str]]) -> None:
    for _, text in pairs:
        assert text.endswith(" ") and text[:-1] in VOCABULARY, text


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fast() -> Iterator[TargetProcess]:
    with start_target(TargetConfig.model_validate(FAST)) as target:
        yield target


# --- wire formats ------------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_openai_stream_decodes_from_raw_bytes(fast: TargetProcess) -> None:
    reply = post(fast.url + OPENAI, openai_body(stream_options={"include_usage": True}))
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/event-stream"
    assert "Content-Encoding" not in reply.headers
    assert_ids_consecutive(reply)
    first, finish, usage, done = (reply.events[0].data, reply.events[-3].data,
                                  reply.events[-2].data, reply.events[-1].data)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pairs = content_events(reply, openai_text)
    assert 4 <= len(pairs) <= 8
    assert len(reply.events) == 1 + len(pairs) + 3
    assert_one_word_each(pairs)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": len(pairs),
                              "total_tokens": 3 + len(pairs)}
    assert done == "[DONE]"


@pytest.mark.timeout(20)
def test_openai_usage_only_on_request_and_max_tokens_cuts(fast: TargetProcess) -> None:
    reply = post(fast.url + OPENAI, openai_body(max_tokens=2))
    assert len(content_events(reply, openai_text)) == 2
    assert reply.events[-2].data["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in ev.data for ev in reply.events[:-1])
    reply = post(fast.url + OPENAI, openai_body(max_tokens=50, max_completion_tokens=3))
    assert len(content_events(reply, openai_text)) == 3


@pytest.mark.timeout(20)
def test_anthropic_stream_decodes_from_raw_bytes(fast: TargetProcess) -> None:
    reply = post(fast.url + ANTHROPIC, anthropic_body(system="be brief"))
    assert reply.status == 200
    assert_ids_consecutive(reply)
    names = [ev.fields["event"] for ev in reply.events]
    n = names.count("content_block_delta")
    assert 4 <= n <= 8
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * n,
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(ev.data["type"] == ev.fields["event"] for ev in reply.events)
    start = reply.events[0].data["message"]
    assert start["role"] == "assistant" and start["usage"]["input_tokens"] == 5
    assert_one_word_each(content_events(reply, anthropic_text))
    delta = reply.events[-2].data
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert delta["usage"] == {"output_tokens": n}

    capped = post(fast.url + ANTHROPIC, anthropic_body(max_tokens=1))
    assert len(content_events(capped, anthropic_text)) == 1
    assert capped.events[-2].data["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("version", ["v1beta", "v1"])
def test_gemini_stream_decodes_from_raw_bytes(fast: TargetProcess, version: str) -> None:
    path = GEMINI.replace("v1beta", version)
    reply = post(fast.url + path, gemini_body(), headers={"x-goog-api-key": "k"})
    assert reply.status == 200
    # Gemini frames every line with CRLF, so events end in a blank CRLF line.
    assert reply.raw.endswith(b"\r\n\r\n") and b"\n\n" not in reply.raw.replace(b"\r\n", b"")
    assert reply.raw.count(b"\r\n\r\n") == len(reply.events)
    assert_ids_consecutive(reply)
    pairs = content_events(reply, gemini_text)
    assert 4 <= len(pairs) <= 8 and len(reply.events) == len(pairs) + 1
    assert_one_word_each(pairs)
    for ev, _ in pairs:
        cand = ev.data["candidates"][0]
        assert cand["content"]["role"] == "model" and "finishReason" not in cand
        assert ev.data["modelVersion"] == "gemini-test"
    last = reply.events[-1].data
    assert last["candidates"][0]["finishReason"] == "STOP"
    assert last["usageMetadata"] == {"promptTokenCount": 3, "candidatesTokenCount": len(pairs),
                                     "totalTokenCount": 3 + len(pairs)}

    capped = post(fast.url + path, gemini_body(maxOutputTokens=2))
    assert len(content_events(capped, gemini_text)) == 2
    assert capped.events[-1].data["candidates"][0]["finishReason"] == "MAX_TOKENS"


@pytest.mark.timeout(20)
def test_gemini_without_alt_sse_is_a_clear_400(fast: TargetProcess) -> None:
    for path in ("/v1beta/models/g:streamGenerateContent", "/v1beta/models/g:generateContent"):
        reply = post(fast.url + path, gemini_body())
        assert reply.status == 400
        err = reply.json()["error"]
        assert err["status"] == "INVALID_ARGUMENT" and "alt=sse" in err["message"]


@pytest.mark.timeout(20)
def test_generic_sse_stream(fast: TargetProcess) -> None:
    reply = post(fast.url + GENERIC, generic_body())
    assert_ids_consecutive(reply)
    pairs = content_events(reply, generic_text)
    assert_one_word_each(pairs)
    assert reply.events[-1].data == {"done": True, "usage": {"output_tokens": len(pairs)}}
    assert len(content_events(post(fast.url + GENERIC, generic_body(max_tokens=1)),
                              generic_text)) == 1


@pytest.mark.timeout(30)
def test_each_format_streams_where_it_declares_its_routes(fast: TargetProcess) -> None:
    # The target serves every registered format at the routes the format declares: the load
    # generator's own request of each (its path and body) streams, and so does each fixed route.
    for name in protocols.names():
        fmt = protocols.get(name)
        fixed = [r.path for r in fmt.routes() if "{" not in r.path]
        for path in dict.fromkeys([fmt.path("sim-1"), *fixed]):
            reply = post(fast.url + path, fmt.body_for(path, "sim-1", "hello", 3))
            assert reply.status == 200, (name, path, reply.raw[:200])
            assert reply.headers["Content-Type"].startswith("text/event-stream"), (name, path)
            assert reply.events, (name, path)


@pytest.mark.timeout(20)
def test_healthz_and_unknown_paths(fast: TargetProcess) -> None:
    assert get(fast.url + "/healthz") == (200, b'{"status": "ok"}')
    assert get(fast.url + "/v1/nothing")[0] == 404
    assert post(fast.url + "/v1beta/models/g:countTokens?alt=sse", gemini_body()).status == 404


BAD_BODIES = [
    (OPENAI, b"{not json", "valid JSON"),
    (OPENAI, b"\xff\xfe", "valid JSON"),
    (OPENAI, [1, 2], "JSON object"),
    (OPENAI, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "stream"),
    (OPENAI, openai_body(messages=[]), "messages"),
    (OPENAI, openai_body(max_tokens=0), "max_tokens"),
    (OPENAI, openai_body(max_tokens="5"), "max_tokens"),
    (OPENAI, openai_body(messages=[{"role": "user", "content": 5}]), "content"),
    (ANTHROPIC, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
     "max_tokens"),
    (ANTHROPIC, anthropic_body(stream=False), "stream"),
    (ANTHROPIC, anthropic_body(model=None), "model"),
    (GEMINI, {"contents": "hello"}, "contents"),
    (GEMINI, {"contents": [{"parts": "x"}]}, "parts"),
    (GEMINI, gemini_body(maxOutputTokens=-1), "maxOutputTokens"),
    (GENERIC, {"max_tokens": 3}, "prompt"),
]


@pytest.mark.timeout(30)
def test_bad_request_bodies_get_400_in_the_protocol_shape(fast: TargetProcess) -> None:
    for path, body, hint in BAD_BODIES:
        reply = post(fast.url + path, body)
        assert reply.status == 400, (path, body)
        doc = reply.json()
        message = doc["error"]["message"]
        assert hint in message, (path, body, message)
        if path == ANTHROPIC:
            assert doc["type"] == "error"
            assert doc["error"]["type"] == "invalid_request_error"
        if path == OPENAI:
            assert doc["error"]["type"] == "invalid_request_error"


# --- behaviour under configuration -------------------------------------------------------------


@pytest.mark.timeout(30)
def test_error_rate_one_fails_every_request_in_its_protocol_shape() -> None:
    cfg = TargetConfig.model_validate({**FAST, "error_rate": "100%"})
    with start_target(cfg) as target:
        for path, body in ((OPENAI, openai_body()), (ANTHROPIC, anthropic_body()),
                           (GEMINI, gemini_body()), (GENERIC, generic_body())):
            for _ in range(3):
                reply = post(target.url + path, body)
                assert reply.status == 500
                doc = reply.json()
                assert "error" in doc and not reply.events
        assert post(target.url + ANTHROPIC, anthropic_body()).json()["error"]["type"] == "api_error"
        assert post(target.url + GEMINI, gemini_body()).json()["error"]["status"] == "INTERNAL"


def _reproduced(ttft: str, itl: str) -> tuple[float, float]:
    """Median TTFT and mean ITL (ms) over 3 streams of 30 tokens from a target with these."""
    cfg = TargetConfig.model_validate(
        {"ttft": ttft, "itl": itl, "output_tokens": {"min": 30, "max": 30}}
    )
    ttfts, itls = [], []
    with start_target(cfg) as target:
        for _ in range(3):
            reply = post(target.url + GENERIC, generic_body())
            times = [ev.at for ev, _ in content_events(reply, generic_text)]
            assert len(times) == 30
            ttfts.append((times[0] - reply.sent) * 1000)
            itls.append((times[-1] - times[0]) / 29 * 1000)
    return statistics.median(ttfts), statistics.median(itls)


@pytest.mark.timeout(60)
def test_fixed_ttft_and_itl_are_reproduced() -> None:
    # Margins: the server sleeps to absolute deadlines (below: never short by more than 2 ms,
    # 10 %). Above: 15 ms and 10 % on top of what the same target configured with 50 ms and
    # 5 ms adds over those, measured right here (loopback, and how late a busy machine wakes
    # a sleeper, alike for both).
    ttft_50, itl_5 = _reproduced("50ms", "5ms")
    ttft, itl = _reproduced("200ms", "20ms")
    assert 198 <= ttft <= 215 + max(0.0, ttft_50 - 50), (ttft, ttft_50)
    assert 18 <= itl <= 22 + max(0.0, itl_5 - 5), (itl, itl_5)


@pytest.mark.timeout(30)
def test_capacity_queues_the_second_stream_behind_the_first() -> None:
    cfg = TargetConfig.model_validate(
        {"ttft": "100ms", "itl": "10ms", "output_tokens": {"min": 11, "max": 11}, "capacity": 1}
    )
    with start_target(cfg) as target:
        replies = post_many(target.url + GENERIC, [generic_body(), generic_body()])
    firsts = sorted(content_events(r, generic_text)[0][0].at - r.sent for r in replies)
    ends = sorted(r.events[-1].at - r.sent for r in replies)
    generation_s = 0.100 + 10 * 0.010
    assert firsts[0] >= 0.095, firsts
    # The queued stream's TTFT includes the whole first generation: it starts once the first
    # stream has ended, and takes one TTFT from there, late by no more than the first
    # stream's own TTFT was (what this machine adds now) and 60 ms.
    assert firsts[1] >= generation_s + 0.095 and firsts[1] >= ends[0], (firsts, ends)
    assert firsts[1] - ends[0] <= 0.100 + max(0.0, firsts[0] - 0.100) + 0.060, (firsts, ends)


async def _abandon_queued_then_measure(url: str) -> float:
    """A holds the one slot, B gives up while queued, A hangs up: C must not wait for B."""
    holder = asyncio.ensure_future(_fetch(url, generic_body(), None, None, hang_up_after=20))
    await asyncio.sleep(0.05)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_fetch(url, generic_body(), None, None, None), 0.2)
    await holder
    reply = await _fetch(url, generic_body(max_tokens=2), None, None, None)
    return content_events(reply, generic_text)[0][0].at - reply.sent


@pytest.mark.timeout(30)
def test_hang_up_frees_the_slot_quietly_and_secrets_are_not_logged(tmp_path: Path) -> None:
    cfg = TargetConfig.model_validate(
        {"ttft": "300ms", "itl": "10ms", "output_tokens": {"min": 500, "max": 500}, "capacity": 1}
    )
    log = tmp_path / "target.log"
    secret = "sk-SECRET-do-not-log"
    with start_target(cfg, log_path=log) as target:
        auth = {"Authorization": f"Bearer {secret}", "x-api-key": secret,
                "x-goog-api-key": secret}
        for path, body in ((OPENAI, openai_body()), (ANTHROPIC, anthropic_body()),
                           (GEMINI + f"&key={secret}", gemini_body())):
            left = post(target.url + path, body, headers=auth, hang_up_after=4)
            assert left.status == 200
        # Each abandoned stream had ~5 s to go, and the abandoned queued one would hold the
        # slot for its 300 ms TTFT if its handler were not cancelled; a freed slot answers in
        # one TTFT (not before), not two (however busy the machine: 250 ms late is a hang).
        ttft = asyncio.run(_abandon_queued_then_measure(target.url + GENERIC))
        assert 0.295 <= ttft < 2 * 0.300 - 0.050, ttft
        assert target.proc.poll() is None
    text = log.read_text()
    assert "Traceback" not in text and "Error" not in text, text
    assert secret not in text


@pytest.mark.timeout(30)
def test_https_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=20,
    )
    cfg = TargetConfig.model_validate({**FAST, "tls_cert": str(cert), "tls_key": str(key)})
    with start_target(cfg) as target:
        assert target.url.startswith("https://127.0.0.1:")
        reply = post(target.url + GENERIC, generic_body(),
                     ssl_ctx=ssl.create_default_context(cafile=str(cert)))
        assert reply.status == 200 and reply.events[-1].data["done"] is True


@pytest.mark.timeout(30)
def test_seeded_responses_replay_and_match_the_plan() -> None:
    cfg = TargetConfig.model_validate({**FAST, "output_tokens": {"min": 3, "max": 40}})
    texts = []
    for _ in range(2):
        with start_target(cfg) as target:
            texts.append([
                "".join(t for _, t in content_events(post(target.url + GENERIC, generic_body()),
                                                     generic_text))
                for _ in range(3)
            ])
    assert texts[0] == texts[1]
    assert len(set(texts[0])) == 3
    for index, text in enumerate(texts[0], start=1):
        plan, _ = plan_response(cfg, index, None)
        assert text == "".join(VOCABULARY[i] + " " for i in plan.tokens)


@pytest.mark.timeout(30)
def test_gpu_clock_scale_multiplies_delays(tmp_path: Path) -> None:
    # The NVML reader is another module's job; a stand-in factor of 2 checks that it is applied.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, types\n"
        "m = types.ModuleType('streamquake.embedded.gpu_speed')\n"
        "m.slowdown_factor = lambda: 2.0\n"
        "sys.modules['streamquake.embedded.gpu_speed'] = m\n"
    )
    log = tmp_path / "send.jsonl"
    cfg = TargetConfig.model_validate(
        {"ttft": "100ms", "itl": "10ms", "output_tokens": {"min": 11, "max": 11},
         "gpu_clock_scale": True, "send_log": str(log)}
    )
    with start_target(cfg, env={"PYTHONPATH": str(tmp_path)}) as target:
        reply = post(target.url + GENERIC, generic_body())
    assert len(content_events(reply, generic_text)) == 11
    # The target's own send times (its send log), not when this client read them: a client
    # that read the first token late (a busy machine) saw the ten gaps as 185 ms.
    (line,) = read_send_log(log)
    sent = [ns / 1e9 for ns in token_sent_ns(line)]
    assert len(sent) == 11, line
    # Twice the configured delays: never less (a sleep is not short); a factor applied twice
    # (four times) could not come under 0.400 s, whatever the machine's load adds.
    ttft = sent[0] - line["admitted_ns"] / 1e9
    assert 0.195 <= ttft < 0.380, ttft
    assert 0.195 <= sent[-1] - sent[0] < 0.380, sent[-1] - sent[0]


# --- the process and its command line ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_cli_reads_a_config_file_and_restricts_protocols(tmp_path: Path) -> None:
    cfg = TargetConfig.model_validate(FAST)
    path = tmp_path / "target.json"
    path.write_text(cfg.model_dump_json(by_alias=True))
    cmd = procs.python_module_cmd("streamquake.embedded", "--port", "0", "--config", str(path),
                                  "--protocol", "anthropic")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = procs.spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        url = procs.read_listening_line(proc, 15, "the target")
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert post(url + ANTHROPIC, anthropic_body()).status == 200
        for path_, body in ((OPENAI, openai_body()), (GEMINI, gemini_body()),
                            (GENERIC, generic_body())):
            assert post(url + path_, body).status == 404
    finally:
        assert procs.stop(proc) == 0
        assert proc.stderr is not None and proc.stdout is not None
        assert b"Traceback" not in proc.stderr.read()
        proc.stderr.close()
        proc.stdout.close()


def test_config_json_round_trips() -> None:
    cfg = TargetConfig.model_validate({
        "ttft": {"dist": "lognormal", "median": "250ms", "sigma": 0.5},
        "itl": {"dist": "normal", "mean": "20ms", "stddev": "5ms"},
        "output_tokens": {"min": 10, "max": 20}, "capacity": 4, "error_rate": "5%", "seed": 3,
        "protocols": ["openai"], "sse_event_ids": False,
    })
    assert TargetConfig.model_validate_json(cfg.model_dump_json(by_alias=True)) == cfg


@pytest.mark.timeout(30)
def test_start_target_reports_the_child_stderr_on_failure(tmp_path: Path) -> None:
    cfg = TargetConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(tmp_path / "k.pem"))
    with pytest.raises(TargetError, match="cannot load TLS certificate"):
        start_target(cfg)
    with pytest.raises(TargetError, match="No such file"):
        start_target(TargetConfig(), cmd_prefix=[str(tmp_path / "no-such-wrapper")])
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)", "--"]
    started = time.monotonic()
    with pytest.raises(TargetError, match="did not report ready"):
        start_target(TargetConfig(), cmd_prefix=sleeper, ready_timeout_s=1.0)
    assert time.monotonic() - started < 10


# --- timing.py ---------------------------------------------------------------------------------


def test_delay_sampling_is_seeded_and_shaped() -> None:
    lognormal = TargetConfig.model_validate(
        {"ttft": {"dist": "lognormal", "median": "100ms", "sigma": 0.8}}
    ).ttft
    draws = [sample_ms(lognormal, request_rng(1, i)) for i in range(4000)]
    assert draws[:5] == [sample_ms(lognormal, request_rng(1, i)) for i in range(5)]
    assert 92 <= statistics.median(draws) <= 108
    normal = TargetConfig.model_validate({"itl": {"dist": "normal", "mean": 5, "stddev": 20}}).itl
    rng = request_rng(0, 0)
    assert min(sample_ms(normal, rng) for _ in range(2000)) == 0.0
    fixed = TargetConfig().ttft
    sampler = DelaySampler(fixed, fixed, request_rng(0, 0), scale=lambda: 1.5)
    assert sampler.ttft_s() == pytest.approx(0.3)


@pytest.mark.timeout(30)
def test_default_streams_carry_only_data_lines_like_the_real_apis() -> None:
    """The real Gemini, OpenAI and Anthropic APIs send no SSE ``id:`` lines (google-genai even
    rejects them), so by default neither does the target; ``sse_event_ids: true`` adds them."""
    cfg = TargetConfig.model_validate({**FAST, "sse_event_ids": False})
    cfg_default = TargetConfig.model_validate({k: v for k, v in FAST.items()
                                               if k != "sse_event_ids"})
    assert cfg_default.sse_event_ids is False
    with start_target(cfg) as target:
        for path, body in [(OPENAI, openai_body()), (ANTHROPIC, anthropic_body()),
                           (GEMINI, gemini_body())]:
            reply = post(target.url + path, body)
            assert reply.status == 200 and reply.events, path
            assert b"\nid:" not in b"\n" + reply.raw and all(
                "id" not in ev.fields for ev in reply.events), path
