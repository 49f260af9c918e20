"""The embedded target's prefix (KV) cache, as llama-server keeps one per slot, and the part of
llama-server's slots API that empties it.

A request takes the slot whose cached tokens share the longest prefix with its prompt (ties: the
one used longest ago; an idle slot before a busy one); the shared tokens are cached, the rest
cost ``prefill_per_token`` each before the first token, and the slot then holds this prompt.
Like llama-server, at least the prompt's last token is always read again (``prompt_n`` >= 1).
Tokens are whitespace words, as the usage figures count them. An erase empties a slot at once
(llama-server waits for a busy slot to finish first; either way the next request pays).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from streamquake.embedded.config import PrefixCache
from streamquake.jsontypes import JsonDict

# What GET /slots says of a slot's context size: nothing is limited by it here.
N_CTX = 4096


@dataclass
class Slot:
    id: int
    tokens: tuple[str, ...] = ()
    busy: int = 0
    used: int = 0                      # when last taken, in requests
    prompt_n: int = 0
    cache_n: int = 0


@dataclass(frozen=True)
class Prefill:
    """What one request read: ``cache_n`` prompt tokens from the cache, ``prompt_n`` anew."""

    slot: Slot
    cache_n: int
    prompt_n: int
    prompt_ms: float

    def timings(self) -> JsonDict:
        """llama-server's ``timings`` for the prompt (the stream adds ``predicted_n``)."""
        per = self.prompt_ms / self.prompt_n if self.prompt_n else 0.0
        return {"cache_n": self.cache_n, "prompt_n": self.prompt_n,
                "prompt_ms": round(self.prompt_ms, 3), "prompt_per_token_ms": round(per, 3)}


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SlotCache:
    def __init__(self, config: PrefixCache) -> None:
        self.config = config
        self.slots = [Slot(i) for i in range(config.slots)]
        self._taken = 0

    def take(self, prompt: str) -> Prefill:
        words = tuple(prompt.split())
        self._taken += 1
        slot = max(self.slots, key=lambda s: (not s.busy, _shared(s.tokens, words), -s.used))
        cached = min(_shared(slot.tokens, words), max(0, len(words) - 1))
        fresh = len(words) - cached
        slot.tokens, slot.used, slot.busy = words, self._taken, slot.busy + 1
        slot.prompt_n, slot.cache_n = fresh, cached
        return Prefill(slot, cached, fresh, fresh * self.config.prefill_per_token_ms)

    def release(self, prefill: Prefill) -> None:
        prefill.slot.busy -= 1

    def erase(self, slot_id: int) -> int:
        slot = self.slots[slot_id]
        n = len(slot.tokens)
        slot.tokens = ()
        return n

    def listing(self) -> list[JsonDict]:
        return [{"id": s.id, "n_ctx": N_CTX, "speculative": False, "is_processing": s.busy > 0,
                 "n_prompt_tokens": len(s.tokens), "n_prompt_tokens_processed": s.prompt_n,
                 "n_prompt_tokens_cache": s.cache_n} for s in self.slots]


@asynccontextmanager
async def prefilled(cache: SlotCache | None, prompt: str) -> AsyncIterator[Prefill | None]:
    """Inside a stream's admission: the slot taken and its prefill time slept (None: no cache),
    the slot given back after."""
    if cache is None:
        yield None
        return
    prefill = cache.take(prompt)
    try:
        if prefill.prompt_ms > 0:
            await asyncio.sleep(prefill.prompt_ms / 1000)
        yield prefill
    finally:
        cache.release(prefill)


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"code": status, "message": message, "type": kind}},
                             status=status)


def add_routes(app: web.Application, cache: SlotCache) -> None:
    """llama-server's ``GET /slots`` and ``POST /slots/{id}?action=erase`` (the other actions,
    save and restore, are answered 400 as an unknown action is)."""

    async def listing(request: web.Request) -> web.Response:
        return web.json_response(cache.listing())

    async def action(request: web.Request) -> web.Response:
        raw = request.match_info["id_slot"]
        if not raw.isdigit() or int(raw) >= len(cache.slots):
            return _error(400, "Invalid slot ID")
        if request.query.get("action") != "erase":
            return _error(400, "Invalid action")
        slot = int(raw)
        return web.json_response({"id_slot": slot, "n_erased": cache.erase(slot)})

    app.router.add_get("/slots", listing)
    app.router.add_post("/slots/{id_slot}", action)
