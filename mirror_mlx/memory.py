"""MLX memory housekeeping over a long chat: the buffer cache is emptied as generation goes,
and the weights are wired (kept resident) while an engine is open, where the platform allows.

MLX keeps freed buffers in a cache to reuse them for the same sizes. Speculative decoding
changes its shapes every step (windows of 1 to 11 tokens, 1 to 8 branches, a context one step
longer), and the KV cache grows by reallocating; blocks of sizes that never come back pile up,
and on Metal the cache may grow up to MLX's memory limit (1.5x the recommended working set).
"""

from __future__ import annotations

import threading
import warnings

import mlx.core as mx

from .platform import wired_limit_bytes

# Tokens through the target (prefilled or committed) between two clears of the buffer cache,
# as mlx-lm's generate_step. Measured on the default model in float32 (MLX's CPU backend under
# Metal's cache rule, benchmarks/memory.py, a 30-turn chat): with no clearing the cache
# reached 81 / 210 / 346 MB (AR / SD / Mirror-SD); with these clears it holds at most 15 MB
# between steps, plus the KV cache's old copy at the one step that grew it, and 0 MB between
# turns.
CLEAR_EVERY = 256


def kv_bytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


class CacheClearer:
    """Clears MLX's buffer cache every CLEAR_EVERY tokens of one generation, after the KV
    cache grows, and once more at the generation's end (`finish`)."""

    def __init__(self, kv: list):
        self.kv = kv
        self.since = 0
        self.size = kv_bytes(kv)
        self.grew = False

    def add(self, tokens: int) -> None:
        """`tokens` more went through the target."""
        self.since += tokens
        # The KV cache grows by copying itself (mlx-lm's caches, 256 positions at a time), and
        # the old copy, as large as the whole context's keys and values, would sit in the
        # buffer cache until the next clear. It gets there once the step that grew the cache
        # has been computed, which the next step has waited for: clear then.
        if self.since >= CLEAR_EVERY or self.grew:
            mx.clear_cache()
            self.since = 0
        size = kv_bytes(self.kv)
        self.grew, self.size = size > self.size, size

    def finish(self) -> None:
        """Between turns the chat may idle for minutes: hand what the generation freed back to
        the system. The target's last step may still be computing (it is dispatched before
        its tokens are handed over); wait for it, so that its buffers are freed first."""
        mx.synchronize()
        mx.clear_cache()


class _Wiring:
    """The wired limit is one for the process, and several engines may be open at once: the
    first to open raises it, the last to close puts the old limit back."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._previous: int | None = None

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                size, _ = wired_limit_bytes()
                if size is not None:
                    try:
                        self._previous = mx.set_wired_limit(size)
                    except (RuntimeError, ValueError) as e:
                        warnings.warn(f"could not wire the model's memory ({e}); it may be "
                                      "paged out between turns", stacklevel=3)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._previous is not None:
                # mlx-lm's rule: the limit must not change while work is in flight.
                mx.synchronize()
                mx.set_wired_limit(self._previous)
                self._previous = None

    @property
    def holders(self) -> int:
        return self._holders


wiring = _Wiring()
