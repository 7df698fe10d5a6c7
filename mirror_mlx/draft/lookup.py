"""Prompt lookup: when the last few tokens already occurred in the context, draft what followed
them there, at no cost, and ask the draft network only otherwise.

Copying is what a small draft is worst at and what chat output does all the time: quoting the
prompt (extraction, summaries, translation, code edits) and repeating its own phrases. On the
default target's Spec-Bench outputs, drafting from the context whenever a 3- or 2-token match
exists and from the draft network otherwise commits about 1.5 times as many tokens per target
step as the network alone (benchmarks/acceptance.py measures it). Verification is unchanged,
so this stays lossless: a copied draft is a draft whose distribution q is a point mass
(speculative sampling accepts it with the target's probability of that token and otherwise
resamples from the target without it).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import replace

import numpy as np

from ..decode.sampling import SamplingParams
from .base import Drafter, Job, JobResult, Rollout

MATCH = (3, 2)  # n-gram lengths tried, longest first: a 1-token match copies too often wrongly


def lookup(sequence: list[int], n: int, match: tuple[int, ...] = MATCH) -> list[int] | None:
    """`n` tokens that followed the latest earlier occurrence of the sequence's last k tokens
    (the first k of `match` that occurs), or None. A continuation that runs into the end of
    the sequence goes on with the tokens it copies itself (a repeating pattern repeats)."""
    seq = np.asarray(sequence)
    for k in match:
        if len(seq) <= k:
            continue
        tail = seq[-k:]
        # Starts s < len - k of a k-gram equal to the tail, found on the first token, then the rest.
        starts = np.flatnonzero(seq[: len(seq) - k] == tail[0])
        for j in range(1, k):
            starts = starts[seq[starts + j] == tail[j]]
        if len(starts):
            # What follows the match, repeated with its period (the distance to the end).
            src = int(starts[-1]) + k
            period = len(seq) - src
            return [int(seq[src + i % period]) for i in range(n)]
    return None


class NgramIndex:
    """`lookup` over sequences that begin with a caller's committed tokens (Job.committed),
    at a cost independent of their length: the latest start of every k-gram of the committed
    tokens is kept in a dict, updated as they grow (a different list starts it afresh), and
    only the tokens past them are searched."""

    def __init__(self, match: tuple[int, ...] = MATCH):
        self.match = match
        self.committed: list[int] | None = None
        self.size = 0  # committed tokens indexed
        # k -> k-gram -> its latest start s, for the starts s + k < size: a k-gram that ends
        # at the last committed token may be a sequence's own tail, not an earlier match.
        self.last: dict[int, dict[tuple[int, ...], int]] = {k: {} for k in match}

    def update(self, committed: list[int], n: int | None = None) -> None:
        """Index committed[:n] (all of it by default)."""
        n = len(committed) if n is None else n
        if committed is not self.committed or n < self.size:
            self.committed, self.size = committed, 0
            self.last = {k: {} for k in self.match}
        for k, last in self.last.items():
            lo, hi = max(0, self.size - k), max(0, n - k)
            # dict.update keeps the last start of a repeated k-gram: the latest occurrence.
            last.update(zip(zip(*(committed[lo + j : hi + j] for j in range(k))),
                            range(lo, hi)))
        self.size = n

    def lookup(self, sequence: list[int], n: int) -> list[int] | None:
        """`lookup(sequence, n, match)` for a sequence that begins with the indexed tokens."""
        for k in self.match:
            if len(sequence) <= k:
                continue
            tail = sequence[-k:]
            # The starts past the index, latest first, then the index's latest.
            src = next((s for s in range(len(sequence) - k - 1, max(0, self.size - k) - 1, -1)
                        if sequence[s : s + k] == tail), None)
            if src is None:
                src = self.last[k].get(tuple(tail))
            if src is not None:
                src += k
                period = len(sequence) - src
                return [int(sequence[src + i % period]) for i in range(n)]
        return None


def copied(tokens: list[int], sampling: SamplingParams | None, vocab_size: int,
           ended: bool) -> Rollout:
    """A rollout of copied tokens: the draft is sure of each (q is a point mass). `ended`:
    cut short of the job's n (Job.longest_copy)."""
    n = len(tokens)
    probs = None
    if sampling is not None:
        probs = np.zeros((n, vocab_size), np.float32)
        probs[np.arange(n), tokens] = 1.0
    return Rollout(list(tokens), np.array(tokens, np.int64)[:, None], np.ones((n, 1), np.float32),
                   probs, ended, copied=True)


class LookupDrafter:
    """A Drafter that answers each sequence of a job from the context where it has a match,
    and hands the others to `inner` (any drafter: MLX, Core ML) as one job. So the rollouts of
    Mirror-SD (the early one and the branches) copy wherever they can, as SD's windows do."""

    def __init__(self, inner: Drafter, match: tuple[int, ...] = MATCH):
        self.inner = inner
        self.match = match
        self.vocab_size = inner.vocab_size
        self.context = inner.context
        self.compute = getattr(inner, "compute", "unknown")
        self.feature_layers = inner.feature_layers
        self.inline = inner.inline
        # The target's features of jobs answered from the context alone, for the inner
        # drafter's next job (a draft that reads features needs them all, in order).
        self._features: list = []
        # The main line of the last compacting job whose main sequence was copied: the inner
        # drafter has not seen it, and must compact to it before its next job. Kept as the
        # job's committed tokens (the list, its length then) and the rest of the line.
        self._main: tuple[list[int] | None, int, list[int]] | None = None
        self._index = NgramIndex(match)
        self.copies = 0  # sequences answered from the context

    def _lookup(self, job: Job) -> list[list[int] | None]:
        n = job.n if job.longest_copy is None else min(job.n, job.longest_copy)
        if not n:
            return [None] * len(job.sequences)
        if job.committed is None:
            return [lookup(s, n, self.match) for s in job.sequences]
        self._index.update(job.committed, job.committed_len)
        return [self._index.lookup(s, n) for s in job.sequences]

    def submit(self, job: Job) -> Future[JobResult]:
        start = time.perf_counter()
        found = self._lookup(job)
        ask = [i for i, f in enumerate(found) if f is None]
        self.copies += len(found) - len(ask)
        copies = {i: copied(f, job.sampling, self.vocab_size, len(f) < job.n)
                  for i, f in enumerate(found) if f is not None}
        if job.compact:
            self._main = None
            if found[0] is not None:
                c = job.committed
                if c is None:
                    self._main = (None, 0, list(job.sequences[0]))
                else:
                    n = job.committed_len
                    self._main = (c, n, job.sequences[0][n:])
        if not ask:
            self._features += job.features
            done: Future[JobResult] = Future()
            done.set_result(JobResult([copies[i] for i in range(len(found))], start,
                                      time.perf_counter(), job.label, extra={"lookup": True}))
            return done
        features, self._features = self._features + job.features, []
        inner = replace(job, sequences=[job.sequences[i] for i in ask],
                        compact=job.compact and found[0] is None, features=features)
        main, self._main = self._main, None
        if inner.compact or main is None:
            future = self.inner.submit(inner)
        else:
            c, n, rest = main
            line = rest if c is None else c[:n] + rest
            # The committed tokens vouch for the catch-up's line while they have not grown.
            same = c is not None and len(c) == n
            future = _after(self.inner.submit(Job([line], 0, label="catch-up",
                                                  features=features,
                                                  committed=c if same else None)),
                            self.inner.submit(replace(inner, features=[])))
        return _merge(future, copies, ask) if copies else future

    def run_pending(self) -> None:
        self.inner.run_pending()

    def reseed(self, seed: int | None) -> None:
        self.inner.reseed(seed)

    def close(self) -> None:
        self.inner.close()


def _merge(job: Future[JobResult], copies: dict[int, Rollout], asked: list[int]
           ) -> Future[JobResult]:
    """`job`'s result with the copied rollouts put back in their sequences' places."""
    out: Future[JobResult] = Future()

    def put(_: Future) -> None:
        try:
            done = job.result()
        except BaseException as e:
            out.set_exception(e)
            return
        rollouts = dict(copies) | dict(zip(asked, done.rollouts))
        out.set_result(replace(done, rollouts=[rollouts[i] for i in range(len(rollouts))],
                               extra={**done.extra, "copied": len(copies)}))

    job.add_done_callback(put)
    return out


def _after(first: Future[JobResult], job: Future[JobResult]) -> Future[JobResult]:
    """`job`'s result, counting the work of `first`, which ran just before it, as its own."""
    both: Future[JobResult] = Future()

    def merge(_: Future) -> None:
        try:
            a, b = first.result(), job.result()
        except BaseException as e:
            both.set_exception(e)
            return
        both.set_result(replace(b, start=a.start, fed_tokens=a.fed_tokens + b.fed_tokens,
                                forwards=a.forwards + b.forwards))

    job.add_done_callback(merge)
    return both
