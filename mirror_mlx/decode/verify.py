"""Acceptance of drafted tokens against the target: pure functions, no models.

Both rules return (A, c): A drafted tokens accepted, then c, the target's own token at
position A (the correction, or a bonus token when all drafts were accepted). Every committed
token is therefore the target's: greedy output equals target-only greedy decoding, and
speculative sampling leaves the target's distribution unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from .sampling import Sampler, distribution


def greedy_accept(target_ids: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
    """`target_ids[i]`: the target's argmax after the window's first i + 1 tokens."""
    a = 0
    while a < len(drafts) and drafts[a] == target_ids[a]:
        a += 1
    return a, int(target_ids[a])


def speculative_accept(
    p: np.ndarray,
    q: np.ndarray,
    drafts: Sequence[int],
    uniform: Callable[[], float],
    draw: Callable[[np.ndarray], int],
) -> tuple[int, int]:
    """Standard speculative sampling. `p`: (len(drafts) + 1, V) target distributions at the
    window positions; `q`: (len(drafts), V) the draft distributions each token was drawn from.
    Accept draft x with probability min(1, p(x) / q(x)); on the first rejection draw the
    correction from max(0, p - q), renormalized; after full acceptance draw from p."""
    for i, x in enumerate(drafts):
        if uniform() * q[i, x] < p[i, x]:
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        # p == q up to rounding: the rejection had probability ~0; fall back to p itself.
        return i, draw(residual / total if total > 1e-12 else p[i])
    return len(drafts), draw(p[len(drafts)])


def judge(logits: mx.array, drafts: Sequence[int], q: np.ndarray | None, sampler: Sampler,
          accept=speculative_accept) -> tuple[int, int]:
    """(A, c) for a window's target logits (len(drafts) + 1, V), greedy or sampled as the
    sampler's parameters say. `accept` is replaceable only so tests can show a wrong rule
    fails the distribution test."""
    if sampler.params.greedy:
        return greedy_accept(mx.argmax(logits, axis=-1).tolist(), drafts)
    p = np.array(distribution(logits, sampler.params))
    return accept(p, q, drafts, sampler.uniform, sampler.draw)
