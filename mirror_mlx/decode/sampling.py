"""Logits -> the distribution a token is drawn from (temperature, top-k, top-p, min-p), and a
seeded sampler. Speculative sampling applies the same `distribution` to target and draft, so
acceptance compares like with like."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import InvalidParameter


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        def bad(msg: str):
            raise InvalidParameter(msg)

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            bad(f"temperature must be a finite number (got {self.temperature!r})")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top-p must be in (0, 1] (got {self.top_p})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top-k must be a non-negative integer (got {self.top_k!r})")
        if not 0.0 <= self.min_p < 1.0:
            bad(f"min-p must be in [0, 1) (got {self.min_p})")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative integer (got {self.seed!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distribution(logits: mx.array, params: SamplingParams) -> mx.array:
    """Probabilities (float32, same shape as `logits`) after temperature, top-k, top-p, min-p,
    in that order. Needs temperature > 0."""
    x = logits.astype(mx.float32) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = mx.min(mx.topk(x, params.top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x >= kth, x, -mx.inf)
    probs = mx.softmax(x, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        ranked = mx.take_along_axis(probs, order, axis=-1)
        # Keep the smallest head of the ranking whose mass reaches top_p (the crossing token too).
        keep_ranked = (mx.cumsum(ranked, axis=-1) - ranked) < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_ranked), order, keep_ranked, axis=-1)
        probs = mx.where(keep, probs, 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * mx.max(probs, axis=-1, keepdims=True)
        probs = mx.where(probs >= floor, probs, 0.0)
    return probs / mx.sum(probs, axis=-1, keepdims=True)


class Sampler:
    """Draws tokens and uniforms from one seeded generator, so a seed fixes a whole generation."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def pick(self, logits: mx.array) -> int:
        """Next token from one row of logits."""
        if self.params.greedy:
            return int(mx.argmax(logits, axis=-1).item())
        return self.draw(np.asarray(distribution(logits, self.params)))

    def draw(self, probs: np.ndarray) -> int:
        cdf = np.cumsum(probs, dtype=np.float64)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"),
                       len(cdf) - 1))

    def uniform(self) -> float:
        return float(self.rng.random())
