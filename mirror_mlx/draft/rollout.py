"""Running a draft job over any executor (MLX, Core ML): the token tree in the KV cache, the
masks and positions of batched branch rollouts, and the choice of each drafted token.

Cache layout. Slots [0, len(trunk)) hold one linear token sequence, the trunk; the slots after
it hold branches ("paths"), each hanging off the trunk at some position. A token of a branch
attends to the trunk up to where its branch leaves it and to its own branch's earlier slots,
so many branches advance in one batched forward: one forward per drafted token, whatever the
number of branches.

A job that compacts (the first of each decoding step) makes its first sequence the main line:
the deepest prefix of it that the cache holds (the trunk, possibly continued along a branch the
previous step rolled out, whose slots are gathered into place) becomes the trunk, and the
other branches are forgotten. Other jobs only add branches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..decode.sampling import distribution
from .base import Job, JobResult, Rollout

PREFILL_CHUNK = 512


class Executor(Protocol):
    """Runs the draft network over its own KV cache."""

    vocab_size: int
    head_ids: np.ndarray  # head index -> token id
    streams: int  # tokens each forward predicts beyond the next one (speculative streaming)

    def truncate(self, size: int) -> None:
        """Keep slots [0, size)."""

    def gather(self, dst: int, slots: list[int]) -> None:
        """Move the given slots to [dst, dst + len(slots)); the cache then ends there."""

    def forward(self, tokens: list[int], positions: list[int] | int, mask: np.ndarray | None,
                rows: list[int]) -> np.ndarray:
        """Append `tokens` at the cache's end; return float32 logits (len(rows), 1 + streams,
        head size) for the listed token rows: the next token, then (with speculative
        streaming) the ones after it. `positions`: one per token, or an int (contiguous).
        `mask`: bool (len(tokens), cache size after the append), True = may attend; None =
        causal over the whole cache."""


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Path:
    """A branch: tokens at positions [start, start + len) whose KV sits in `slots`."""

    start: int
    tokens: list[int]
    slots: list[int]


@dataclass
class TreeState:
    trunk: list[int] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    size: int = 0  # slots in use

    def deepest(self, seq: list[int]) -> tuple[int, Path | None, int]:
        """Longest prefix of `seq` in the cache: (length, branch it runs along, tokens of it)."""
        p = common_prefix(self.trunk, seq)
        best, via, used = p, None, 0
        for path in self.paths:
            if path.start == p:
                m = common_prefix(path.tokens, seq[p:])
                if p + m > best:
                    best, via, used = p + m, path, m
        return best, via, used


def _compact(main: list[int], ex: Executor, state: TreeState) -> int:
    """Make the cached prefix of `main` the trunk; returns its length."""
    depth, via, used = state.deepest(main)
    keep = depth - used
    if via is not None:
        ex.gather(keep, via.slots[:used])
    else:
        ex.truncate(keep)
    state.trunk, state.paths, state.size = main[:depth], [], depth
    return depth


def run_job(job: Job, ex: Executor, state: TreeState, rng: np.random.Generator,
            top_k: int = 4) -> JobResult:
    try:
        return _run(job, ex, state, rng, top_k)
    except BaseException:
        # The cache may be half-updated: forget it; the next job prefills afresh.
        state.trunk, state.paths, state.size = [], [], 0
        ex.truncate(0)
        raise


def _run(job: Job, ex: Executor, state: TreeState, rng: np.random.Generator,
         top_k: int) -> JobResult:
    start = time.perf_counter()
    seqs = [list(s) for s in job.sequences]
    if not seqs or any(not s for s in seqs):
        raise ValueError("a draft job needs non-empty sequences")
    # Each sequence's last token is fed by the rollout, which needs its logits; a prefill
    # (n == 0) stops before it and leaves it to the next job.
    caps = [len(s) - 1 for s in seqs]
    fed = 0
    reused = 0
    if job.compact:
        reused = _compact(seqs[0][: caps[0]], ex, state)
        # Extend the trunk with what every sequence shares.
        shared = min(caps)
        for s in seqs[1:]:
            shared = min(shared, common_prefix(seqs[0], s))
        if shared > len(state.trunk):
            ext = seqs[0][len(state.trunk) : shared]
            for at in range(0, len(ext), PREFILL_CHUNK):
                ex.forward(ext[at : at + PREFILL_CHUNK], len(state.trunk) + at, None, [])
            state.trunk = seqs[0][:shared]
            state.size = shared
            fed += len(ext)
    if job.n == 0:
        return JobResult([], start, time.perf_counter(), job.label, fed_tokens=fed,
                         reused_tokens=reused)

    # Roll out every sequence as a branch, one batched forward per drafted token.
    branches = []
    for s, cap in zip(seqs, caps):
        depth, via, m = state.deepest(s[:cap])
        branches.append(Path(depth - m, via.tokens[:m] if via else [],
                             via.slots[:m] if via else []))
        if not job.compact:
            reused += depth
    feed = [s[b.start + len(b.tokens):] for s, b in zip(seqs, branches)]
    drafted: list[list[int]] = [[] for _ in seqs]
    tops, top_probs, qs = [[] for _ in seqs], [[] for _ in seqs], [[] for _ in seqs]
    forwards = 0
    # With speculative streaming a forward drafts 1 + streams tokens per branch.
    for _ in range(-(-job.n // (1 + ex.streams))):
        if job.cancel is not None and job.cancel.is_set():
            break
        tokens, positions, owners = [], [], []
        for b, toks in enumerate(feed):
            at = branches[b].start + len(branches[b].tokens)
            tokens += toks
            positions += range(at, at + len(toks))
            owners += [b] * len(toks)
        new_size = state.size + len(tokens)
        mask = np.zeros((len(tokens), new_size), dtype=bool)
        rows = []
        for i, b in enumerate(owners):
            path = branches[b]
            path.tokens.append(tokens[i])
            path.slots.append(state.size + i)
            mask[i, : path.start] = True
            mask[i, path.slots] = True
            if i + 1 == len(owners) or owners[i + 1] != b:
                rows.append(i)
        logits = ex.forward(tokens, positions, mask, rows)
        forwards += 1
        fed += len(tokens)
        state.size = new_size
        take = min(logits.shape[1], job.n - len(drafted[0]))
        chosen = _choose(logits[:, :take].reshape(-1, logits.shape[-1]), ex.head_ids,
                         ex.vocab_size, job, rng, top_k)
        feed = [[] for _ in seqs]
        for i, (token, ids, probs, q) in enumerate(chosen):
            b = i // take
            drafted[b].append(token)
            feed[b].append(token)
            tops[b].append(ids)
            top_probs[b].append(probs)
            if q is not None:
                qs[b].append(q)
    state.paths += [b for b in branches if b.tokens]
    rollouts = [
        Rollout(drafted[b], np.array(tops[b]), np.array(top_probs[b]),
                np.stack(qs[b]) if qs[b] else None)
        for b in range(len(seqs))
    ]
    return JobResult(rollouts, start, time.perf_counter(), job.label, fed_tokens=fed,
                     forwards=forwards, reused_tokens=reused)


def _choose(logits: np.ndarray, head_ids: np.ndarray, vocab: int, job: Job, rng, top_k: int):
    """Per row: (token, top-k token ids, their probabilities, full-vocabulary q or None)."""
    if job.sampling is None:
        z = logits - logits.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
    else:
        p = np.array(distribution(mx.array(logits), job.sampling))
    k = min(top_k, p.shape[-1])
    out = []
    for row in p:
        idx = np.argpartition(-row, k - 1)[:k]
        idx = idx[np.argsort(-row[idx])]
        ids = head_ids[idx]
        if job.sampling is None:
            out.append((int(ids[0]), ids, row[idx], None))
            continue
        cdf = np.cumsum(row, dtype=np.float64)
        pick = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")),
                   len(row) - 1)
        q = np.zeros(vocab, dtype=np.float32)
        q[head_ids] = row
        out.append((int(head_ids[pick]), ids, row[idx], q))
    return out
