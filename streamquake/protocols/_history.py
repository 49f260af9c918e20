"""A conversation's request bodies: the formats whose requests carry a message history (a
system prompt, then the earlier turns' user prompts and the answers received), and how each
writes one. The load generator's conversation classes (a request class's ``conversation``)
send every turn so; the formats without a history (legacy completions, llama.cpp's native
``/completion``, generic SSE) take one prompt and cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from streamquake.jsontypes import JsonDict, JsonValue
from streamquake.protocols.base import Protocol
from streamquake.protocols.openai import is_legacy_path

__all__ = ["HISTORY_FORMATS", "has_history", "with_history"]

# (user prompt, the answer's text as received), one pair per earlier turn.
Turns = Sequence[tuple[str, str]]


def _message(role: str, text: str) -> JsonValue:
    return {"role": role, "content": text}


def _gemini_message(role: str, text: str) -> JsonValue:
    return {"role": role, "parts": [{"text": text}]}


def _dialogue(turns: Turns, prompt: str, message: Callable[[str, str], JsonValue] = _message,
              answerer: str = "assistant") -> list[JsonValue]:
    """Each earlier turn's prompt and answer, then the new prompt, as the format's messages."""
    out: list[JsonValue] = []
    for asked, answer in turns:
        out += [message("user", asked), message(answerer, answer)]
    out.append(message("user", prompt))
    return out


def _chat(body: JsonDict, system: str, turns: Turns, prompt: str) -> JsonDict:
    # OpenAI chat: the system prompt is the first message, so a prefix cache keeps it.
    first = [_message("system", system)] if system else []
    body["messages"] = first + _dialogue(turns, prompt)
    return body


def _anthropic(body: JsonDict, system: str, turns: Turns, prompt: str) -> JsonDict:
    # Anthropic's messages take no system role: the system prompt is the top-level field.
    if system:
        body["system"] = system
    body["messages"] = _dialogue(turns, prompt)
    return body


def _gemini(body: JsonDict, system: str, turns: Turns, prompt: str) -> JsonDict:
    if system:
        body["systemInstruction"] = {"parts": [{"text": system}]}
    body["contents"] = _dialogue(turns, prompt, _gemini_message, answerer="model")
    return body


def _responses(body: JsonDict, system: str, turns: Turns, prompt: str) -> JsonDict:
    # The Responses API's ``input`` as a list of messages, the system prompt first.
    first = [_message("system", system)] if system else []
    body["input"] = first + _dialogue(turns, prompt)
    return body


_WRITERS: dict[str, Callable[[JsonDict, str, Turns, str], JsonDict]] = {
    "openai": _chat, "anthropic": _anthropic, "gemini": _gemini,
    "openai_responses": _responses}

# The formats whose requests carry a message history (OpenAI's chat, not its legacy
# completions: ``has_history`` tells them apart by the path).
HISTORY_FORMATS: tuple[Protocol, ...] = ("openai", "anthropic", "gemini", "openai_responses")


def has_history(protocol: Protocol, path: str | None) -> bool:
    """Whether requests of ``protocol`` sent to ``path`` (the scenario's ``target.path``, None
    for the format's own) carry a message history."""
    if protocol not in _WRITERS:
        return False
    return not (protocol == "openai" and path is not None and is_legacy_path(path))


def with_history(protocol: Protocol, body: JsonDict, system: str, turns: Turns,
                 prompt: str) -> JsonDict:
    """``body`` (the format's one-prompt body, which it takes and returns) with its messages
    replaced by the conversation: ``system`` (none if empty), each earlier turn's prompt and
    answer, then ``prompt``. LookupError for a format without a history (the scenario's
    schema refuses those before any load)."""
    writer = _WRITERS.get(protocol)
    if writer is None:
        raise LookupError(f"{protocol!r} requests carry no message history; formats with one: "
                          f"{', '.join(HISTORY_FORMATS)}")
    return writer(body, system, turns, prompt)
