"""The official SDKs stream from the embedded target unchanged and reassemble its exact output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamquake.embedded.config import TargetConfig
from streamquake.embedded.formats import VOCABULARY
from streamquake.embedded.process import TargetProcess, start_target
from streamquake.embedded.timing import plan_response

PROMPT = "write a short poem about streams"  # 6 words: the target's prompt token count
CONFIG = {"ttft": "5ms", "itl": "1ms", "output_tokens": {"min": 5, "max": 30}, "seed": 11}
# A hang guard, not a speed check: the test imports its SDK (the import is part of what it
# tries), and importing anthropic alone took 2.7 s of CPU on an idle core here; under
# scripts/test-stress --hogs 4 (five test workers and four busy loops on two cores) it ran past
# 30 s, mid-import.
SDK_TIMEOUT_S = 120


def expected_text(cfg: TargetConfig, request_index: int, max_tokens: int | None) -> str:
    plan, _ = plan_response(cfg, request_index, max_tokens)
    return "".join(VOCABULARY[i] + " " for i in plan.tokens)


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Iterator[tuple[TargetProcess, TargetConfig]]:
    """A fresh target per test, so the SDK's request is the target's request number 1."""
    cfg = TargetConfig.model_validate({**CONFIG, **getattr(request, "param", {})})
    with start_target(cfg) as proc:
        yield proc, cfg


@pytest.mark.timeout(SDK_TIMEOUT_S)
def test_openai_sdk_streams_text_and_usage(target: tuple[TargetProcess, TargetConfig]) -> None:
    from openai import OpenAI

    proc, cfg = target
    text, usage = [], None
    with OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        stream = client.chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=20,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    want = expected_text(cfg, 1, 20)
    assert "".join(text) == want
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (6, len(want.split()))
    assert usage.total_tokens == 6 + len(want.split())


@pytest.mark.timeout(SDK_TIMEOUT_S)
def test_anthropic_sdk_streams_text_and_usage(target: tuple[TargetProcess, TargetConfig]) -> None:
    from anthropic import Anthropic

    proc, cfg = target
    with Anthropic(base_url=proc.url, api_key="x", max_retries=0, timeout=10) as client:  # noqa: SIM117
        with client.messages.stream(
            model="claude-test", max_tokens=8, messages=[{"role": "user", "content": PROMPT}]
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    want = expected_text(cfg, 1, 8)
    assert text == want
    assert final.usage.input_tokens == 6
    assert final.usage.output_tokens == len(want.split())
    assert final.stop_reason == ("max_tokens" if len(want.split()) == 8 else "end_turn")


@pytest.mark.timeout(SDK_TIMEOUT_S)
@pytest.mark.parametrize("api_version", [None, "v1beta"])
def test_google_genai_sdk_streams_text_and_usage(
    target: tuple[TargetProcess, TargetConfig], api_version: str | None
) -> None:
    # google-genai treats any SSE line other than "data: " as raw JSON: the target's default
    # stream, like the real API's, has none. Its default path is /v1/, v1beta is asked for.
    from google import genai
    from google.genai import types

    proc, cfg = target
    options = types.HttpOptions(base_url=proc.url, api_version=api_version, timeout=10_000)
    client = genai.Client(api_key="x", http_options=options)
    text, usage = [], None
    stream = client.models.generate_content_stream(
        model="gemini-test",
        contents=PROMPT,
        config=types.GenerateContentConfig(max_output_tokens=25),
    )
    for chunk in stream:
        text.append(chunk.text or "")
        usage = chunk.usage_metadata or usage
    client.close()
    want = expected_text(cfg, 1, 25)
    assert "".join(text) == want
    assert usage is not None
    assert usage.prompt_token_count == 6
    assert usage.candidates_token_count == len(want.split())
    assert usage.total_token_count == 6 + len(want.split())
