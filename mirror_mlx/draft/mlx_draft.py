"""The MLX drafter: runs the draft network on its own worker thread with its own stream, so
its forwards run in parallel with the target's (MLX releases the GIL while it computes; a
stream belongs to the thread that made it: PLATFORM.md)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..decode.schedule import device_name
from .base import Job, JobResult
from .net import DraftNet
from .rollout import TreeState, run_job


class MLXExecutor:
    def __init__(self, net: DraftNet):
        self.net = net
        self.vocab_size = net.config.vocab_size
        self.head_ids = np.array(net.head_ids)
        self.streams = net.config.stream_count
        self.cache = [KVCache() for _ in net.layers]

    def truncate(self, size: int) -> None:
        for c in self.cache:
            c.offset = min(c.offset, size)

    def gather(self, dst: int, slots: list[int]) -> None:
        idx = mx.array(slots, dtype=mx.int32)
        for c in self.cache:
            c.keys[..., dst : dst + len(slots), :] = c.keys[..., idx, :]
            c.values[..., dst : dst + len(slots), :] = c.values[..., idx, :]
            c.offset = dst + len(slots)

    def forward(self, tokens, positions, mask, rows) -> np.ndarray:
        if not isinstance(positions, int):
            positions = mx.array([positions], dtype=mx.int32)
        mask = "causal" if mask is None else mx.array(mask)[None, None]
        x = mx.array([tokens])
        if not rows:
            self.net.hidden(x, positions, mask, self.cache)
            mx.eval([c.keys for c in self.cache] + [c.values for c in self.cache])
            return np.zeros((0, 1 + self.streams, 0), np.float32)
        idx = mx.array(rows)
        if self.streams:
            main, streams = self.net.hidden_with_streams(x, positions, mask, self.cache, rows)
            h = mx.concatenate([main[0, idx, None], streams[0]], axis=1)
        else:
            h = self.net.hidden(x, positions, mask, self.cache)[0, idx, None]
        return np.array(self.net.logits(h).astype(mx.float32))


class MLXDrafter:
    """A Drafter whose jobs run, in order, on one worker thread."""

    def __init__(self, net: DraftNet, top_k: int = 4):
        self.net = net
        self.vocab_size = net.config.vocab_size
        self.context = None
        self.head_ids = np.array(net.head_ids)  # the tokens its head scores
        self.compute = f"mlx:{device_name(mx.default_device())}"  # where its stream computes
        self.top_k = top_k
        self._executor = MLXExecutor(net)
        self._state = TreeState()
        self._rng = np.random.default_rng()
        self._stream = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mirror-draft",
                                        initializer=self._make_stream)

    def _make_stream(self) -> None:
        self._stream = mx.new_stream(mx.default_device())

    def submit(self, job: Job) -> Future[JobResult]:
        return self._pool.submit(self._run, job)

    def run_pending(self) -> None:
        pass

    def reseed(self, seed: int | None) -> None:
        self._pool.submit(self._seed, seed)  # in order with the jobs around it

    def _seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(None if seed is None else seed + 1)

    def _run(self, job: Job) -> JobResult:
        with mx.stream(self._stream):
            return run_job(job, self._executor, self._state, self._rng, self.top_k)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
