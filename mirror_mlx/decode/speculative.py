"""Vanilla speculative decoding: the draft proposes a window of tokens, the target verifies them
all in one forward pass. Serial: T = T_draft(gamma) + T_target(gamma + 1)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from ..draft.base import DRAFT_WAIT_S, Drafter, Features, Job
from ..models import split
from .length import DraftLength
from .sampling import Sampler
from .stats import GenerationStats
from .verify import judge, speculative_accept


def speculative(model: nn.Module, cache: list, drafter: Drafter, committed: list[int],
                sampler: Sampler, stats: GenerationStats, gamma: int | DraftLength, limit: int,
                features: list[Features] | None = None,
                accept=speculative_accept) -> Iterator[list[int]]:
    """Yields the tokens each step commits. `committed` ends with the last token, which the
    target's `cache` does not hold yet; the draft keeps its own cache (see draft/base.py).
    `gamma`: a fixed window, or the adaptive length's state (decode/length.py). `features`:
    the target's features the draft has not seen yet (from the prefill), when it reads them."""
    committed = list(committed)
    q_params = None if sampler.params.greedy else sampler.params
    taps = drafter.feature_layers
    pending = list(features or [])
    adaptive = isinstance(gamma, DraftLength)
    while True:
        longest = gamma.longest if adaptive else gamma
        g = max(0, min(longest, limit - len(committed)))
        t0 = time.perf_counter()
        drafts, q = [], None
        drafting = not adaptive or gamma.drafting(sampler.params.temperature)
        asked = g
        if g:
            job = Job([committed], g, q_params, features=pending,
                      min_confidence=gamma.threshold() if adaptive else 0.0,
                      committed=committed, copy_only=not drafting)
            done = drafter.submit(job).result(DRAFT_WAIT_S)
            pending = []
            draft = done.rollouts[0]
            drafts, q = draft.tokens, draft.probs
            if adaptive and not done.extra.get("lookup"):
                gamma.record_draft(done.end - done.start, max(1, done.forwards))
        t1 = time.perf_counter()
        g = len(drafts)
        logits, feats = split.forward(model, mx.array([committed[-1:] + drafts]), cache, taps)
        accepted, token = judge(logits[0], drafts, q, sampler, accept)
        for c in cache:
            c.trim(g - accepted)
        new = drafts[:accepted] + [token]
        if taps:
            # The target's features after the window's first A + 1 tokens: those of the
            # tokens committed now, for the draft's next job.
            pending.append(Features.of(committed + new, len(committed) - 1, feats, accepted + 1))
        t2 = time.perf_counter()
        stats.add_time("draft", t1 - t0)
        stats.add_time("target", t2 - t1)
        if adaptive:
            gamma.record_target(t2 - t1, g)
            stats.draft_lengths[g] = stats.draft_lengths.get(g, 0) + 1
            if drafting and asked:
                gamma.record_step(sampler.params.temperature, len(new), g, t1 - t0)
        stats.record_step(g, accepted)
        committed += new
        yield new
