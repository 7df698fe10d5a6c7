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


def copied(tokens: list[int], sampling: SamplingParams | None, vocab_size: int) -> Rollout:
    """A rollout of copied tokens: the draft is sure of each (q is a point mass)."""
    n = len(tokens)
    probs = None
    if sampling is not None:
        probs = np.zeros((n, vocab_size), np.float32)
        probs[np.arange(n), tokens] = 1.0
    return Rollout(list(tokens), np.array(tokens, np.int64)[:, None], np.ones((n, 1), np.float32),
                   probs)


class LookupDrafter:
    """A Drafter that answers a job from the context when every sequence in it has a match,
    and hands it to `inner` (any drafter: MLX, Core ML) otherwise."""

    def __init__(self, inner: Drafter, match: tuple[int, ...] = MATCH):
        self.inner = inner
        self.match = match
        self.vocab_size = inner.vocab_size
        self.context = inner.context
        # The main line of the last compacting job answered here: the inner drafter has not
        # seen it, and must compact to it before any job that only adds branches.
        self._main: list[int] | None = None
        self.copies = 0  # jobs answered from the context

    def submit(self, job: Job) -> Future[JobResult]:
        if job.n:
            start = time.perf_counter()
            found = [lookup(s, job.n, self.match) for s in job.sequences]
            if all(f is not None for f in found):
                if job.compact:
                    self._main = list(job.sequences[0])
                self.copies += 1
                done: Future[JobResult] = Future()
                done.set_result(JobResult(
                    [copied(f, job.sampling, self.vocab_size) for f in found], start,
                    time.perf_counter(), job.label, extra={"lookup": True}))
                return done
        main, self._main = self._main, None
        if job.compact or main is None:
            return self.inner.submit(job)
        catch_up = self.inner.submit(Job([main], 0, label="catch-up"))
        return _after(catch_up, self.inner.submit(job))

    def run_pending(self) -> None:
        self.inner.run_pending()

    def reseed(self, seed: int | None) -> None:
        self.inner.reseed(seed)

    def close(self) -> None:
        self.inner.close()


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
