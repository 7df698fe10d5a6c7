"""Vanilla speculative decoding: the draft proposes gamma tokens, the target verifies them all
in one forward pass. Serial: T = T_draft(gamma) + T_target(gamma + 1)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from ..draft.base import Drafter, Job
from ..measure.stats import GenerationStats
from .sampling import Sampler
from .verify import judge, speculative_accept


def speculative(model: nn.Module, cache: list, drafter: Drafter, committed: list[int],
                sampler: Sampler, stats: GenerationStats, gamma: int, limit: int,
                accept=speculative_accept) -> Iterator[list[int]]:
    """Yields the tokens each step commits. `committed` ends with the last token, which the
    target's `cache` does not hold yet; the draft keeps its own cache (see draft/base.py)."""
    committed = list(committed)
    q_params = None if sampler.params.greedy else sampler.params
    while True:
        g = max(0, min(gamma, limit - len(committed)))
        t0 = time.perf_counter()
        drafts, q = [], None
        if g:
            draft = drafter.submit(Job([committed], g, q_params)).result().rollouts[0]
            drafts, q = draft.tokens, draft.probs
        t1 = time.perf_counter()
        logits = model(mx.array([committed[-1:] + drafts]), cache=cache)[0]
        accepted, token = judge(logits, drafts, q, sampler, accept)
        for c in cache:
            c.trim(g - accepted)
        t2 = time.perf_counter()
        stats.add_time("draft", t1 - t0)
        stats.add_time("target", t2 - t1)
        stats.record_step(g, accepted)
        new = drafts[:accepted] + [token]
        committed += new
        yield new
