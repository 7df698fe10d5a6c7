"""The host's bookkeeping per draft job does not grow with the context: Mirror-SD's jobs (an
early rollout, then 8 branches) read the same number of their sequences' tokens and run the
same Python lines at 256 and at 8,192 tokens of context, counted, not timed. The executor is
a stand-in that returns fixed logits: the rollout's bookkeeping is what is measured, not a
network (benchmarks/host_work.py times the same)."""

import sys
from concurrent.futures import Future

from mirror_mlx.draft.base import Features, Job
from mirror_mlx.draft.lookup import LookupDrafter, NgramIndex, lookup
from mirror_mlx.draft.rollout import TreeState, common_prefix, run_job

import numpy as np
import pytest


class Counted(list):
    """A token list that counts the tokens read from it by index or slice."""

    reads = 0

    def __getitem__(self, i):
        Counted.reads += len(range(*i.indices(len(self)))) if isinstance(i, slice) else 1
        return super().__getitem__(i)


class StandIn:
    """Executor and inline Drafter at once: logits drawn beforehand, no network."""

    def __init__(self, reads_features: bool):
        self.vocab_size = 1000
        self.head_ids = np.arange(256)
        self.streams = 0
        self.reads_features = reads_features
        self.context = None
        self.compute = "stand-in"
        self.inline = True
        self.feature_layers = (1,) if reads_features else ()
        self.logits = np.random.default_rng(0).normal(size=(64, 1, 256)).astype(np.float32)
        self.forwards = 0
        self.state = TreeState()

    def truncate(self, size):
        pass

    def gather(self, dst, slots):
        pass

    def forward(self, tokens, positions, mask, rows, features=None):
        self.forwards += 1
        at = 5 * self.forwards % 32
        return self.logits[at : at + len(rows)]

    def submit(self, job):
        done = Future()
        done.set_result(run_job(job, self, self.state, np.random.default_rng(0)))
        return done

    def run_pending(self):
        pass


def traced(fn, *args) -> tuple[int, object]:
    """Python lines run by fn(*args), and what it returns."""
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        out = fn(*args)
    finally:
        sys.settrace(None)
    return lines, out


def work(context: int, reads_features: bool, steps: int = 3) -> tuple[int, int]:
    """(tokens read from the jobs' sequences, Python lines run) over `steps` Mirror-SD steps
    (early job, 8 branches, commit), as mirror.py submits them, after a prompt of `context`
    distinct tokens."""
    drafter = LookupDrafter(StandIn(reads_features))
    committed = Counted(range(1000, 1000 + context))

    def features(line, start, n):
        return [Features(Counted(line), start, np.ones((n, 4), np.float32))] \
            if reads_features else []

    window = drafter.submit(Job([committed], 5, features=features(committed, 0, context - 1),
                                committed=committed)).result().rollouts[0]
    Counted.reads, lines, pending = 0, 0, []
    for step in range(steps):
        drafts = window.tokens
        picks = [(r % 6, 900 + 8 * step + r) for r in range(8)]
        jobs = [Job([Counted(committed + drafts)], 6, label="early", features=pending,
                    committed=committed),
                Job([Counted(committed + drafts[:r] + [v]) for r, v in picks], 5,
                    compact=False, features=features(committed + drafts, len(committed) - 1, 6),
                    committed=committed)]
        ran, results = traced(lambda d, js: [d.submit(j).result() for j in js], drafter, jobs)
        lines += ran
        r, v = picks[2]
        pending = features(committed + drafts[:r] + [v], len(committed) - 1, r + 1)
        committed += drafts[:r] + [v]
        window = results[1].rollouts[2]
    return Counted.reads, lines


@pytest.mark.parametrize("reads_features", [False, True], ids=["tokens", "features"])
def test_a_jobs_bookkeeping_does_not_grow_with_the_context(reads_features):
    short, long = work(256, reads_features), work(8192, reads_features)
    assert long[0] == short[0] > 0
    # Lines may differ by a few where the collector runs a finalizer inside the trace; the
    # bookkeeping that grew with the context ran 20 times as many at 8,192 tokens.
    assert long[1] <= 1.02 * short[1], (short, long)


def test_common_prefix_finds_the_first_difference_from_a_known_start():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = rng.integers(0, 3, rng.integers(0, 80)).tolist()
        b = a[: rng.integers(0, len(a) + 1)] + rng.integers(0, 3, rng.integers(0, 40)).tolist()
        naive = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == naive
        start = int(rng.integers(0, naive + 1))
        assert common_prefix(a, b, start) == naive
        stop = int(rng.integers(0, 90))
        assert common_prefix(a, b, min(start, stop), stop) == min(naive, stop)


def test_the_ngram_index_finds_what_lookup_finds():
    """As a context grows (and when a new list rewrites it), the index copies exactly what a
    search of the whole sequence copies, for sequences that continue the context."""
    rng = np.random.default_rng(1)
    index = NgramIndex()
    for _ in range(6):
        committed = rng.integers(0, 6, rng.integers(0, 30)).tolist()  # rewritten history
        for _ in range(30):
            for _ in range(4):
                seq = committed + rng.integers(0, 6, rng.integers(0, 7)).tolist()
                if seq:
                    index.update(committed)
                    assert index.lookup(seq, 5) == lookup(seq, 5), seq
            committed += rng.integers(0, 6, rng.integers(1, 4)).tolist()


def test_a_sequence_that_does_not_begin_with_the_committed_tokens_is_refused():
    with pytest.raises(ValueError, match="committed"):
        Job([[1, 2, 9]], 3, committed=[1, 2, 3])
    with pytest.raises(ValueError, match="committed"):
        Job([[1, 2]], 3, committed=[1, 2, 3])
