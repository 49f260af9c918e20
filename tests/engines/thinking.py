"""llama-server streaming ``reasoning_content``: the tiny model of ``tests.engines.model`` with a
thinking model's chat template and tags, so that llama.cpp parses what it generates as
reasoning until ``</think>``, and ``--reasoning-budget N`` ends the thinking after N tokens.

The template opens the thinking in the generation prompt (``assistant: <think>``) and shows
past reasoning between the tags, which is how llama.cpp recognises a thinking template (its
log says ``thinking = 1``). The vocabulary adds ``<`` and the two tags, so the prompt can hold
them and the engine can force ``</think>`` when the budget is spent. Measured with this build
(0.5.0-dev, from llama-cpp-python 0.3.36), ``max_tokens`` 20 and budget 8: 6
``reasoning_content`` deltas, then 13 ``content`` deltas, with a usage of 20: the closing tag
is a generated token it never streams (with a 2 x 256 model, 6 and 12: the newline after it
neither).

Tool calls (a template with ``<tool_call>``): this build recognises the format and writes a
grammar, but fails the request with "Failed to initialize samplers" for this model, so tool-call
streams are tested against servers that send real ones' exact bytes (tests/part_servers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import gguf

from tests.engines import model
from tests.engines.llama_server import LlamaServer, serve

THINK_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}assistant: "
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n"
    "{% endif %}{{ message.content }}\n{% else %}{{ message.role }}: {{ message.content }}\n"
    "{% endif %}{%- endfor %}{%- if add_generation_prompt %}assistant: <think>\n{% endif %}"
)
ALIAS = "tiny-thinker"
_BASE_VOCABULARY = model.vocabulary


def _vocabulary() -> tuple[list[str], list[float], list[gguf.TokenType]]:
    tokens, scores, types = _BASE_VOCABULARY()
    return (tokens + ["<", "<think>", "</think>"], scores + [-1000.0, 0.0, 0.0],
            types + [gguf.TokenType.NORMAL, gguf.TokenType.USER_DEFINED,
                     gguf.TokenType.USER_DEFINED])


def write_thinking_model(path: Path) -> Path:
    """``tests.engines.model.write_model``'s model, with the thinking template and tags."""
    with mock.patch.multiple(model, vocabulary=_vocabulary, CHAT_TEMPLATE=THINK_TEMPLATE):
        return model.write_model(path)


def serve_thinking(workdir: Path, budget: int, slots: int = 2) -> Iterator[LlamaServer]:
    """llama-server with the thinking model and ``--reasoning-budget budget``; stopped after."""
    yield from serve(workdir, slots=slots, model_file=write_thinking_model(
        workdir / "tiny-thinker.gguf"), alias=ALIAS, extra=(
        "--reasoning-format", "deepseek", "--reasoning-budget", str(budget)))
