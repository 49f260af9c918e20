"""Validation of request bodies the embedded target receives, shared by the formats.

Every helper raises ``BadRequest`` with a sentence naming the field, which the target answers
with 400 in the format's own error shape.
"""

from __future__ import annotations

from streamquake.jsontypes import JsonDict
from streamquake.protocols.base import BadRequest


def count_tokens(text: str) -> int:
    # A whitespace word count is close enough for usage figures; no tokenizer is simulated.
    return len(text.split())


def require_object(body: object) -> JsonDict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def optional_positive_int(body: JsonDict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer, got {value!r}")
    return value


def required_str(body: JsonDict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{key}' is required and must be a non-empty string")
    return value


def require_stream(body: JsonDict) -> None:
    if body.get("stream") is not True:
        raise BadRequest("this target only simulates streaming: set \"stream\": true")


def text_of_content(content: object, where: str) -> str:
    """Text of an OpenAI/Anthropic ``content``: a string or a list of typed blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [b.get("text", "") for b in content if isinstance(b, dict)]
        return " ".join(t for t in texts if isinstance(t, str))
    raise BadRequest(f"{where} must be a string or a list of content blocks")


def messages_text(body: JsonDict) -> str:
    """All the text of a chat ``messages`` list (OpenAI and Anthropic share its shape)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list")
    texts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object")
        texts.append(text_of_content(msg.get("content", ""), f"messages[{i}].content"))
    return " ".join(texts)
