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

# The buffer cache is cleared each time a generation's position (tokens in the target's KV
# cache) passes a multiple of CLEAR_EVERY: mlx-lm's period (generate_step), and the one at
# which mlx-lm's KV cache reallocates, so the old copy it leaves in the cache goes soon after.
# Measured on the default model in float32 (Mirror-SD, MLX's CPU backend under Metal's cache
# rule, benchmarks/memory.py, two 300-token replies): between clears the cache gains about
# 0.1 MB per token (shapes that do not come back) and the KV cache's old copy when it grows;
# it held at most 33 and 45 MB in the two replies (53 MB with a clear every 256 tokens
# wherever they fell, 91 and 124 MB with none). The clear at a generation's end empties it
# for the idle time between turns.
CLEAR_EVERY = 256


class CacheClearer:
    """Clears MLX's buffer cache as one generation moves along the context (`at`), and once
    more at its end (`finish`)."""

    def __init__(self):
        self.position = 0

    def at(self, position: int) -> None:
        """The target's cache now holds `position` tokens."""
        if position // CLEAR_EVERY != self.position // CLEAR_EVERY:
            mx.clear_cache()
        self.position = position

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
