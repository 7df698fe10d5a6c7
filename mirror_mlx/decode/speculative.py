"""Vanilla speculative decoding: the draft proposes a window of tokens, the target verifies them
all in one forward pass. Serial: T = T_draft(gamma) + T_target(gamma + 1)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft.base import DRAFT_WAIT_S, Drafter, Features, Job
from ..models import split
from .length import DraftLength
from .sampling import Sampler
from .stats import GenerationStats
from .verify import judge, speculative_accept


@dataclass
class Window:
    """A step's drafts and the target's forward over them, dispatched (not yet waited for)."""

    drafts: list[int]
    q: np.ndarray | None  # the draft distributions the drafts were drawn from; None: greedy
    logits: mx.array  # (len(drafts) + 1, V)
    features: list[mx.array]  # the target's outputs at the draft's feature layers
    dispatched: float  # perf_counter seconds
    copied: bool  # the drafts are a copy from the context

    @staticmethod
    def verify(model: nn.Module, cache: list, last: int, drafts: list[int],
               q: np.ndarray | None, taps: tuple[int, ...], copied: bool = False) -> Window:
        dispatched = time.perf_counter()
        logits, features = split.forward(model, mx.array([[last] + drafts]), cache, taps)
        logits = logits[0]
        mx.async_eval(logits, *features)
        return Window(drafts, q, logits, features, dispatched, copied)


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
    temperature = sampler.params.temperature

    def room() -> int:
        """The most tokens the step may draft."""
        return max(0, min(gamma.longest if adaptive else gamma, limit - len(committed)))

    def draft_and_verify(g: int, drafting: bool) -> tuple[Window, float]:
        """The step's window of at most `g` drafts (only a copy from the context where it
        does not draft), its forward dispatched; and the seconds drafting took."""
        nonlocal pending
        t0 = time.perf_counter()
        drafts, q, copied = [], None, False
        if g:
            job = Job([committed], g, q_params, features=pending,
                      min_confidence=gamma.threshold() if adaptive else 0.0,
                      committed=committed, copy_only=not drafting,
                      longest_copy=gamma.longest_copy(temperature) if adaptive else None)
            done = drafter.submit(job).result(DRAFT_WAIT_S)
            pending = []
            rollout = done.rollouts[0]
            drafts, q, copied = rollout.tokens, rollout.probs, rollout.copied
            if adaptive and not copied:
                gamma.record_draft(done.end - done.start, max(1, done.forwards))
        drafted = time.perf_counter() - t0
        return Window.verify(model, cache, committed[-1], drafts, q, taps, copied), drafted

    drafting = not adaptive or gamma.drafting(temperature)
    ahead = None  # the step's window, when it was dispatched before the last yield
    while True:
        resumed = time.perf_counter()
        asked = room()
        window, draft_s = ahead or draft_and_verify(asked, drafting)
        # The target's time on this step's path: from its dispatch, or, for a window
        # dispatched ahead (it computed partly while the caller worked), from the resume.
        t1 = max(window.dispatched, resumed)
        drafts, g = window.drafts, len(window.drafts)
        accepted, token = judge(window.logits, drafts, window.q, sampler, accept)
        for c in cache:
            c.trim(g - accepted)
        new = drafts[:accepted] + [token]
        if taps:
            # The target's features after the window's first A + 1 tokens: those of the
            # tokens committed now, for the draft's next job.
            pending.append(Features.of(committed + new, len(committed) - 1, window.features,
                                       accepted + 1))
        t2 = time.perf_counter()
        stats.add_time("draft", draft_s)
        stats.add_time("target", t2 - t1)
        if adaptive:
            if ahead is None:  # the caller's work is not the target's
                gamma.record_target(t2 - t1, g)
            elif g:
                # A copy dispatched ahead, priced from its dispatch (the caller's little work
                # overlaps it): where drafting is off only such windows are verified, and
                # unmeasured, their cost per token would be a guess (1% of a step; 20% here).
                gamma.record_target(t2 - window.dispatched, g)
            stats.draft_lengths[g] = stats.draft_lengths.get(g, 0) + 1
            if window.copied:
                gamma.record_copy(temperature, g, accepted)
            if drafting and asked:
                gamma.record_step(temperature, len(new), g, draft_s)
        stats.record_step(g, accepted)
        committed += new
        drafting = not adaptive or gamma.drafting(temperature)
        # A next step that drafts nothing (at most a free copy from the context) has its
        # window now: its forward computes while the caller works, as AR's does.
        ahead = None if drafting else draft_and_verify(room(), False)
        yield new
