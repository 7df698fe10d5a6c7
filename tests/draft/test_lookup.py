"""Prompt lookup: what it copies, and that the draft network behind it stays in step (a draft
equal to the target must still draft the target's greedy tokens after lookups answered
jobs in its place)."""

from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.draft.base import Job
from mirror_mlx.draft.lookup import LookupDrafter, copied, lookup
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.draft.net import DraftNet

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step


def test_lookup_copies_what_followed_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 8, 1, 2, 3], 3) == [9, 8, 1]
    # The latest occurrence wins.
    assert lookup([5, 6, 1, 5, 6, 2, 0, 5, 6], 2) == [2, 0]
    # A 3-token match is preferred to a later 2-token one.
    assert lookup([4, 5, 6, 7, 0, 5, 6, 3, 4, 5, 6], 1) == [7]
    # Without a 3-token match, a 2-token one.
    assert lookup([1, 2, 7, 3, 1, 2], 2) == [7, 3]


def test_a_copy_that_reaches_the_end_repeats_the_pattern():
    assert lookup([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert lookup([1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_no_match_no_draft():
    assert lookup([1, 2, 3, 4, 5], 3) is None
    assert lookup([1, 1], 3) is None  # too short for any match
    assert lookup([3, 1, 2, 3], 2, match=(2,)) is None


def test_a_copied_draft_is_certain():
    greedy = copied([4, 2], None, 10, False)
    assert greedy.probs is None and greedy.top_ids[:, 0].tolist() == [4, 2]
    assert greedy.copied and not greedy.ended
    sampled = copied([4, 2], SamplingParams(temperature=0.8), 10, True)
    assert sampled.probs.shape == (2, 10) and sampled.probs.sum() == 2.0
    assert sampled.probs[0, 4] == 1.0 and sampled.probs[1, 2] == 1.0


@pytest.fixture(scope="module")
def drafter(target):
    inner = MLXDrafter(DraftNet.from_model(target.model))  # all layers: the target itself
    yield LookupDrafter(inner)
    inner.close()


def greedy(target, seq, n):
    return [t for t, _ in generate_step(mx.array(seq), target.model, max_tokens=n)]


def test_the_network_catches_up_after_lookups(target, drafter):
    inner = drafter.inner._state
    text = target.tokenizer.encode("one two three four, one two three four, one two")
    plain = target.tokenizer.encode("The largest river in Europe is")
    assert lookup(text, 4) is not None and lookup(plain, 4) is None

    first = drafter.submit(Job([plain], 4)).result()
    assert "lookup" not in first.extra
    assert first.rollouts[0].tokens == greedy(target, plain, 4)

    # A step whose window is copied: the network is not asked, its cache is untouched.
    main = plain + first.rollouts[0].tokens + text
    copy = drafter.submit(Job([main], 4)).result()
    assert copy.extra["lookup"] and copy.rollouts[0].tokens == lookup(main, 4)
    # The cache holds the prompt and the drafts fed after it (not the last, never fed).
    assert inner.deepest(main)[0] == len(plain) + 3

    # Branches beside that step go to the network, which first compacts to the main line.
    branches = [main[:-2] + [100], main[:-1] + [200]]
    late = drafter.submit(Job(branches, 3, compact=False)).result()
    assert "lookup" not in late.extra
    assert inner.trunk == main[:-1] and len(inner.paths) == 2
    for seq, rollout in zip(branches, late.rollouts):
        assert rollout.tokens == greedy(target, seq, 3)
    # Its work counts the catch-up: main's tokens past the 3 drafts the cache held, then
    # one token per branch per forward.
    assert late.fed_tokens == (len(main) - 1) - (len(plain) + 3) + 2 * 3


def test_each_sequence_is_copied_where_it_matches_and_the_rest_drafted(target, drafter):
    text = target.tokenizer.encode("red green blue, red green blue, red green")
    plain = target.tokenizer.encode("Paris is the capital of")
    copies = drafter.copies
    result = drafter.submit(Job([text, plain], 3)).result()
    assert result.extra["copied"] == 1 and drafter.copies == copies + 1
    assert [r.tokens for r in result.rollouts] == [lookup(text, 3), greedy(target, plain, 3)]
    assert np.array_equal(result.rollouts[1].top_ids[:, 0], greedy(target, plain, 3))
    # The main line was copied, so the network compacted to it before drafting the other.
    assert drafter.inner._state.trunk == text[:-1]

    # A job that only adds branches is split the same way.
    other = text[:-1] + plain[-2:]
    late = drafter.submit(Job([other, text], 2, compact=False)).result()
    assert [r.tokens for r in late.rollouts] == [greedy(target, other, 2), lookup(text, 2)]


def test_a_copy_is_no_longer_than_the_job_allows(target, drafter):
    text = target.tokenizer.encode("red green blue, red green blue, red green")
    short = drafter.submit(Job([text], 4, longest_copy=2)).result().rollouts[0]
    assert short.copied and short.ended and short.tokens == lookup(text, 2)
    whole = drafter.submit(Job([text], 2, longest_copy=5)).result().rollouts[0]
    assert whole.copied and not whole.ended and whole.tokens == lookup(text, 2)
    # No copy allowed: the network drafts, or, in a step that does not draft, nothing does.
    drafted = drafter.submit(Job([text], 3, longest_copy=0)).result().rollouts[0]
    assert not drafted.copied and drafted.tokens == greedy(target, text, 3)
    none = drafter.submit(Job([text], 3, longest_copy=0, copy_only=True)).result().rollouts[0]
    assert not none.copied and none.tokens == [] and none.ended


def test_a_failure_in_the_catch_up_reaches_the_caller(target, drafter):
    text = target.tokenizer.encode("up and down, up and down, up and")
    assert drafter.submit(Job([text], 3)).result().extra["lookup"]
    executor = drafter.inner._executor
    real = executor.forward

    def lost(*args):
        raise RuntimeError("draft device lost")

    executor.forward = lost
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            drafter.submit(Job([text + [100]], 3, compact=False)).result()
    finally:
        executor.forward = real
    # The network forgot its cache and starts over, exactly.
    assert drafter.submit(Job([text + [100]], 3, compact=False)).result().rollouts[0].tokens \
        == greedy(target, text + [100], 3)
