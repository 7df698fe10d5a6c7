"""Target-only decoding: one forward pass, one token."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from .sampling import Sampler
from .stats import GenerationStats


def autoregressive(
    model: nn.Module, cache: list, last: int, sampler: Sampler, stats: GenerationStats
) -> Iterator[list[int]]:
    """Yields one committed token per step. `cache` holds every committed token but `last`.
    The next forward is dispatched before a token is handed over, so (on a GPU) it computes
    while the caller detokenizes and prints."""
    logits = model(mx.array([[last]]), cache=cache)[0, -1]
    while True:
        token = sampler.pick(logits)
        stats.record_step(0, 0)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.async_eval(logits)
        yield [token]
