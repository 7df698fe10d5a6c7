"""What the decoders need from a draft, whatever runs it (MLX on a worker thread, Core ML on the
Neural Engine).

A draft holds its own KV cache as a token tree. Every job names whole token sequences; the
drafter reuses whatever part of them its cache already holds (the committed context, or a
branch it rolled out in the previous job) and computes the rest. So the decoders never manage
the draft's cache: rolling back, extending after acceptance and adopting a reused branch all
follow from the sequences they ask for.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..decode.sampling import SamplingParams

# The longest a decoder waits for a draft job before it gives the draft up as hung (a job
# takes milliseconds; a first Core ML prediction may take seconds).
DRAFT_WAIT_S = 60.0


class DraftLost(RuntimeError):
    """The draft cannot serve again: the process that ran it ended or was stopped."""


@dataclass
class Features:
    """The target's features (its outputs at a feature-conditioned draft's `feature_layers`,
    concatenated) after the tokens at positions start, start + 1, ... of `line`: what the
    draft reads for the tokens that follow them."""

    line: list[int]
    start: int
    rows: np.ndarray  # (m, len(feature_layers) * target hidden) float32

    @staticmethod
    def of(line: list[int], start: int, outputs: list[mx.array], count: int | None = None
           ) -> Features:
        """From the target's outputs at the feature layers (each (1, T, hidden), as
        models/split.py taps them), for their first `count` positions."""
        rows = mx.concatenate(outputs, axis=-1)[0, :count].astype(mx.float32)
        return Features(line, start, np.array(rows))


class Cancel(Protocol):
    """Asked between a job's forwards (on the thread that runs it) whether to stop."""

    def is_set(self) -> bool: ...


@dataclass
class Job:
    """Draft `n` tokens after each of `sequences` (full token sequences, typically a shared
    context plus a branch). `n == 0` only brings the cache up to date (a prefill).

    `compact`: sequences[0] is the new main line: the cache keeps only what lies on it, and
    branches rolled out earlier that leave it are forgotten. A job that adds branches beside
    those of an earlier job of the same step passes False. `cancel`, once set, ends the job
    after its current forward (its rollouts are then shorter than `n`)."""

    sequences: list[list[int]]
    n: int
    sampling: SamplingParams | None = None  # None: greedy
    label: str = "draft"
    compact: bool = True
    cancel: Cancel | None = None
    # What the target computed since the last job (a draft that reads features keeps them).
    features: list[Features] = field(default_factory=list)
    # Adaptive length: stop drafting a sequence once the draft's chance that all its tokens
    # so far are accepted (the product of its confidences) falls below this.
    min_confidence: float = 0.0
    # The caller's committed tokens: every sequence begins with them, and every feature's line
    # agrees with them before its `start`. A caller that passes the same list to later jobs
    # only appends to it in between (a decoder's context within one generation); the drafter
    # then compares the jobs' sequences with its cache and its n-gram index only from where
    # the list ended before, so a job's bookkeeping does not grow with the context. None: the
    # sequences are compared whole (at C speed).
    committed: list[int] | None = None
    # How many there were when the job was made (the list may grow before the job runs).
    committed_len: int = field(init=False, default=0)
    # Only a copy from the context (prompt lookup, free) may answer: no draft forward. Other
    # sequences get empty rollouts that have `ended`.
    copy_only: bool = False
    # The most tokens a copy from the context may draft (None: n): the decoder's measure of
    # how far copies survive verification at its temperature (decode/length.py).
    longest_copy: int | None = None

    def __post_init__(self) -> None:
        c = self.committed
        self.committed_len = 0 if c is None else len(c)
        if c and any(len(s) < len(c) or s[len(c) - 1] != c[-1] for s in self.sequences):
            raise ValueError("a draft job's sequences must begin with its committed tokens")


@dataclass
class Rollout:
    tokens: list[int]  # the drafted tokens
    top_ids: np.ndarray  # (n, k) the draft's k best tokens at each drafted position
    top_probs: np.ndarray  # (n, k) their probabilities under the draft
    probs: np.ndarray | None = None  # (n, vocab) sampling distributions q; None when greedy
    ended: bool = False  # stopped short of the job's n by its confidence (Job.min_confidence)
    copied: bool = False  # a copy from the context (draft/lookup.py), not the draft's own


@dataclass
class JobResult:
    rollouts: list[Rollout]
    start: float  # perf_counter seconds
    end: float
    label: str = "draft"
    fed_tokens: int = 0  # tokens the draft had to process (a measure of its work)
    forwards: int = 0  # sequential draft forwards the rollout took
    reused_tokens: int = 0  # tokens of the sequences it already held in its cache
    extra: dict = field(default_factory=dict)


class Drafter(Protocol):
    vocab_size: int  # the input vocabulary; must equal the target's
    context: int | None  # the most tokens the draft's cache holds; None: no fixed limit
    head_ids: np.ndarray  # the tokens the draft's head scores (its output vocabulary)
    compute: str  # where it computes: "coreml", or "mlx:" and its MLX device (schedule.py)
    feature_layers: tuple[int, ...]  # target layers it reads (empty: it reads tokens only)
    inline: bool  # its jobs run on the caller's thread, in `run_pending` (Core ML)

    def submit(self, job: Job) -> Future[JobResult]:
        """Queue a job. A threaded drafter starts it at once; an inline one (Core ML on the
        caller's thread) runs it in `run_pending`."""

    def run_pending(self) -> None:
        """Run queued jobs now if this drafter runs on the caller's thread; else return."""

    def reseed(self, seed: int | None) -> None:
        """Seed the draft's own sampling (a generation's seed fixes the whole schedule)."""

    def close(self) -> None:
        """Stop the worker; idempotent."""
