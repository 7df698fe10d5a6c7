"""The draft's token-tree cache against plain generation: a draft equal to the target must draft
exactly the target's greedy tokens, whatever the job reuses, branches or rolls back."""

import math
import time

from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.draft.base import Job
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.draft.net import DraftNet
from mirror_mlx.draft.rollout import _choose

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step


@pytest.fixture(scope="module")
def setup(target):
    drafter = MLXDrafter(DraftNet.from_model(target.model))  # all layers: the target itself
    yield target, drafter
    drafter.close()


def greedy(target, seq, n):
    return [t for t, _ in generate_step(mx.array(seq), target.model, max_tokens=n)]


def test_draft_equal_to_target_drafts_greedy_tokens(setup):
    target, drafter = setup
    C = target.tokenizer.encode("The three largest rivers in Europe are")
    D = drafter.submit(Job([C], 5)).result().rollouts[0].tokens
    assert D == greedy(target, C, 5)

    # The first job of a step continues the window; a second adds branches beside it.
    early = drafter.submit(Job([C + D], 6, label="early")).result()
    assert early.rollouts[0].tokens == greedy(target, C + D, 6)
    assert early.reused_tokens == len(C) + 4  # all but the window's last token were cached
    branches = [C + D[:r] + [v] for r, v in [(0, 100), (2, 200), (5, 300), (4, 17)]]
    late = drafter.submit(Job(branches, 5, compact=False)).result()
    for seq, rollout in zip(branches, late.rollouts):
        assert rollout.tokens == greedy(target, seq, 5)

    # Outcome (2, 200): the branch's rollout becomes the main line, nothing is recomputed.
    C2, D2 = C + D[:2] + [200], late.rollouts[1].tokens
    step = drafter.submit(Job([C2 + D2], 4)).result()
    assert step.rollouts[0].tokens == greedy(target, C2 + D2, 4)
    assert step.reused_tokens == len(C2 + D2) - 1 and step.fed_tokens == 4

    # Outcome "all accepted, then the draft's own guess": the early rollout is reused.
    guess = step.rollouts[0].tokens[0]
    C3, D3 = C2 + D2 + [guess], step.rollouts[0].tokens[1:]
    again = drafter.submit(Job([C3 + D3], 3)).result()
    assert again.rollouts[0].tokens == greedy(target, C3 + D3, 3)
    assert again.reused_tokens == len(C3 + D3) - 1

    # Roll back to a shorter, different context.
    back = drafter.submit(Job([C + [5, 6]], 3)).result()
    assert back.rollouts[0].tokens == greedy(target, C + [5, 6], 3)
    assert back.reused_tokens == len(C)


def test_cancelled_job_stops_early(setup):
    import threading

    target, drafter = setup
    stop = threading.Event()
    stop.set()
    C = target.tokenizer.encode("Once upon a time")
    result = drafter.submit(Job([C], 8, cancel=stop)).result()
    assert result.rollouts[0].tokens == []
    assert drafter.submit(Job([C], 3)).result().rollouts[0].tokens == greedy(target, C, 3)


def test_sampled_drafting_does_not_queue_behind_the_target():
    """The decoder dispatches the target's forward with mx.async_eval and then drafts: the
    draft's sampling distributions must not wait for that work (on a Mac the default stream
    is the GPU's, which the target fills)."""
    a = mx.random.normal((2048, 2048)) / 45
    mx.eval(a)
    logits = np.random.default_rng(0).normal(size=(4, 2000)).astype(np.float32)

    def choose():
        return _choose(logits, np.arange(2000), 2000, Job([[1]], 4, SamplingParams(1.0)),
                       np.random.default_rng(0), 4)

    choose()  # a first call's one-off costs are not what is compared
    start = time.perf_counter()
    mx.eval(a @ a)
    one = time.perf_counter() - start
    # About a second of the default stream's time, whatever this CPU's speed: a fixed count
    # of products is a second on one CPU and a fraction on a faster one.
    queued = a
    for _ in range(min(200, max(4, math.ceil(1.0 / one)))):
        queued = queued @ a
    start = time.perf_counter()
    mx.async_eval(queued)
    chosen = choose()
    drafted = time.perf_counter() - start
    mx.eval(queued)
    target = time.perf_counter() - start
    assert len(chosen) == 4 and all(q is not None for *_, q, _ in chosen)
    assert drafted < target / 4, (drafted, target)


def test_jobs_that_name_their_committed_tokens_stay_exact(setup):
    """The cache compares a job's sequences only past the committed tokens of the last job
    when they are the same list, grown; a new list (a rewritten history) is compared whole."""
    target, drafter = setup
    committed = target.tokenizer.encode("The three largest rivers in Europe are")
    D = drafter.submit(Job([committed], 4, committed=committed)).result().rollouts[0].tokens
    committed += D[:2] + [300]  # two drafts accepted, then a token of the target's
    early = drafter.submit(Job([committed + [17]], 3, committed=committed)).result()
    assert early.rollouts[0].tokens == greedy(target, committed + [17], 3)
    assert early.reused_tokens == len(committed) - 1  # the rejected drafts were cut off

    # The same tokens but an earlier one changed, in a new list: nothing past it is reused.
    rewritten = list(committed)
    rewritten[3] = 555
    again = drafter.submit(Job([rewritten], 3, committed=rewritten)).result()
    assert again.rollouts[0].tokens == greedy(target, rewritten, 3)
    assert again.reused_tokens == 3
