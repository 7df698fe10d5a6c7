"""The MLX drafter: runs the draft network on its own worker thread with its own stream, so
its forwards run in parallel with the target's (MLX releases the GIL while it computes; a
stream belongs to the thread that made it: PLATFORM.md)."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import replace

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..decode.schedule import device_name
from ..models.load import materialize
from .base import Job, JobResult
from .net import DraftNet
from .rollout import FED, OWN, TARGET, FeatureRefs, JobSeeds, TreeState, not_drafted, run_job


class MLXExecutor:
    def __init__(self, net: DraftNet):
        self.net = net
        self.vocab_size = net.config.vocab_size
        self.head_ids = np.array(net.head_ids)
        self.streams = net.config.stream_count
        self.reads_features = net.reads_features
        self.cache = [KVCache() for _ in net.layers]
        # Per slot, a feature-conditioned draft's last-layer output (the next token's feature
        # where the target's is not known) and the feature the slot was fed.
        self.own = self.fed = mx.zeros((0, net.config.hidden_size))
        mx.eval(self.own)  # made here, used on the worker's stream: see ExitHead.load

    def truncate(self, size: int) -> None:
        for c in self.cache:
            c.offset = min(c.offset, size)

    def gather(self, dst: int, slots: list[int]) -> None:
        idx = mx.array(slots, dtype=mx.int32)
        for c in self.cache:
            c.keys[..., dst : dst + len(slots), :] = c.keys[..., idx, :]
            c.values[..., dst : dst + len(slots), :] = c.values[..., idx, :]
            c.offset = dst + len(slots)
        if self.reads_features:
            self.own[dst : dst + len(slots)] = self.own[idx]
            self.fed[dst : dst + len(slots)] = self.fed[idx]

    def forward(self, tokens, positions, mask, rows, features=None) -> np.ndarray:
        if self.reads_features:
            return self._forward_features(tokens, positions, mask, rows, features)
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

    def _forward_features(self, tokens, positions, mask, rows, refs: FeatureRefs):
        """Feed `tokens` with their features, in as few forwards as their dependencies allow:
        a token that reads the own output of one fed in this call waits for it."""
        base = self.cache[0].offset
        T = len(tokens)
        kinds = np.array(refs.kinds)
        ref = np.array(refs.refs)
        # FED reads what slots were fed before this call overwrites them: read it first.
        stale = np.flatnonzero(kinds == FED)
        fed_before = dict(zip(stale.tolist(), self.fed[mx.array(ref[stale])])) \
            if len(stale) else {}
        fused = self.net.fused(_split(self.net, mx.array(np.stack(refs.target)))) \
            if refs.target else None
        self._reserve(base + T)
        tops, start = [], 0
        while start < T:
            end = start + 1
            while end < T and not (kinds[end] == OWN and ref[end] >= base + start):
                end += 1
            g = []
            for i in range(start, end):
                if kinds[i] == TARGET:
                    g.append(fused[ref[i]])
                elif kinds[i] == OWN:
                    g.append(self.own[int(ref[i])])
                elif kinds[i] == FED:
                    g.append(fed_before[i])
                else:
                    g.append(mx.zeros((self.net.config.hidden_size,)))
            g = mx.stack(g)[None]
            if isinstance(positions, int):
                pos = positions + start
            else:
                pos = mx.array([positions[start:end]], dtype=mx.int32)
            m = "causal" if mask is None else mx.array(mask[start:end, : base + end])[None, None]
            top = self.net.top(mx.array([tokens[start:end]]), pos, m, self.cache, g)[0]
            self.own[base + start : base + end] = top
            self.fed[base + start : base + end] = g[0]
            tops.append(top)
            start = end
        mx.eval(self.own, self.fed, [c.keys for c in self.cache], [c.values for c in self.cache])
        if not rows:
            return np.zeros((0, 1, 0), np.float32)
        h = self.net.norm(mx.concatenate(tops)[mx.array(rows)])[:, None]
        return np.array(self.net.logits(h).astype(mx.float32))

    def _reserve(self, size: int) -> None:
        if self.own.shape[0] < size:
            more = mx.zeros((max(size, 2 * self.own.shape[0]) - self.own.shape[0],
                             self.own.shape[1]))
            self.own = mx.concatenate([self.own, more])
            self.fed = mx.concatenate([self.fed, more])


def _split(net: DraftNet, rows: mx.array) -> list[mx.array]:
    size = net.config.feature_size
    return [rows[:, i * size : (i + 1) * size] for i in range(len(net.config.feature_layers))]


class MLXDrafter:
    """A Drafter whose jobs run, in order, on one worker thread."""

    def __init__(self, net: DraftNet, top_k: int = 4, device: mx.Device | None = None):
        self.net = net
        self._device = device or mx.default_device()
        self.vocab_size = net.config.vocab_size
        self.context = None
        self.head_ids = np.array(net.head_ids)  # the tokens its head scores
        self.compute = f"mlx:{device_name(self._device)}"  # where its stream computes
        self.feature_layers = tuple(net.config.feature_layers)
        self.inline = False
        self.top_k = top_k
        materialize(net)  # made on this thread, computed on the worker's
        self._executor = MLXExecutor(net)
        self._state = TreeState()
        self._seeds = JobSeeds()
        self._stream = None
        self._carried: list = []  # features of copy-only jobs, for the next job
        self._closed = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mirror-draft",
                                        initializer=self._make_stream)

    def _make_stream(self) -> None:
        self._stream = mx.new_stream(self._device)

    def submit(self, job: Job) -> Future[JobResult]:
        if job.copy_only:
            # Nothing to compute (a step that does not draft): answered here, without a trip
            # to the worker; the features it brought go with the next job.
            self._carried += job.features
            now = time.perf_counter()
            done: Future[JobResult] = Future()
            done.set_result(JobResult([not_drafted(self.top_k)] * len(job.sequences), now, now,
                                      job.label))
            return done
        if self._carried:
            job, self._carried = replace(job, features=self._carried + job.features), []
        return self._pool.submit(self._run, job)

    def run_pending(self) -> None:
        pass

    def reseed(self, seed: int | None) -> None:
        self._pool.submit(self._seeds.reseed, seed)  # in order with the jobs around it

    def _run(self, job: Job) -> JobResult:
        if self._closed:
            raise CancelledError  # queued when the drafter closed
        with mx.stream(self._stream):
            return run_job(job, self._executor, self._state, self._seeds.next(), self.top_k)

    def close(self) -> None:
        # The worker frees its MLX thread state itself, last (mx.clear_streams, as MLX asks of
        # every thread that used it): left to the thread's end, it takes the GIL after the
        # thread has let go of Python, and a program that exits right after close() aborts
        # now and then ("terminate called without an active exception").
        if self._closed:
            return
        self._closed = True
        self._pool.submit(mx.clear_streams)
        self._pool.shutdown(wait=True)
