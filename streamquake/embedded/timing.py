"""Seeded draws: one ``random.Random`` per request (length, failure, delays), so runs replay."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from streamquake.embedded.config import Delay, Fixed, LogNormal, Normal, TargetConfig
from streamquake.embedded.formats import VOCABULARY

VOCABULARY_SIZE = len(VOCABULARY)


def request_rng(seed: int, request_index: int) -> random.Random:
    """The generator for the ``request_index``-th request of a target seeded with ``seed``."""
    # A string seed is hashed with SHA-512, so nearby (seed, index) pairs give unrelated streams.
    return random.Random(f"{seed}:{request_index}")


def sample_ms(delay: Delay, rng: random.Random) -> float:
    """One draw in milliseconds, never negative."""
    if isinstance(delay, Fixed):
        return delay.value_ms
    if isinstance(delay, Normal):
        return max(0.0, rng.gauss(delay.mean_ms, delay.stddev_ms))
    if isinstance(delay, LogNormal):
        if delay.median_ms <= 0.0:
            return 0.0
        return rng.lognormvariate(math.log(delay.median_ms), delay.sigma)
    raise TypeError(f"unknown delay distribution {delay!r}")


class DelaySampler:
    """Draws one request's TTFT and inter-token gaps, scaled by an optional live factor."""

    def __init__(
        self,
        ttft: Delay,
        itl: Delay,
        rng: random.Random,
        scale: Callable[[], float] | None = None,
    ) -> None:
        self._ttft = ttft
        self._itl = itl
        self._rng = rng
        self._scale = scale
        # The common case, a fixed gap at full speed, skips the per-token sampling call.
        self._fixed_itl_s = (
            itl.value_ms / 1000.0 if isinstance(itl, Fixed) and scale is None else None
        )

    def _scaled_s(self, ms: float) -> float:
        factor = self._scale() if self._scale is not None else 1.0
        return ms * factor / 1000.0

    def ttft_s(self) -> float:
        return self._scaled_s(sample_ms(self._ttft, self._rng))

    def itl_s(self) -> float:
        if self._fixed_itl_s is not None:
            return self._fixed_itl_s
        return self._scaled_s(sample_ms(self._itl, self._rng))


@dataclass(frozen=True)
class ResponsePlan:
    """Everything random about one response except its delays, drawn before it starts."""

    fail: bool
    tokens: tuple[int, ...]  # indices into formats.VOCABULARY
    truncated: bool  # the request's own max tokens cut the sampled length


def plan_response(
    cfg: TargetConfig, request_index: int, max_tokens: int | None
) -> tuple[ResponsePlan, random.Random]:
    """Draw the ``request_index``-th response; the returned generator then yields its delays."""
    rng = request_rng(cfg.seed, request_index)
    fail = rng.random() < cfg.error_rate
    lo, hi = sorted((cfg.output_tokens.min, cfg.output_tokens.max))
    length = rng.randint(lo, hi)
    truncated = max_tokens is not None and length > max_tokens
    if truncated and max_tokens is not None:
        length = max_tokens
    tokens = tuple(rng.choices(range(VOCABULARY_SIZE), k=length))
    return ResponsePlan(fail=fail, tokens=tokens, truncated=truncated), rng
