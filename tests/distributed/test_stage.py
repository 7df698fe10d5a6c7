"""A stage's share of the layers, on its own cache (the layers before it never ran there),
computes what the whole model computes, for every family the split runs: masks made from
the stage's own first layers, sliding windows included, through a prefill, steps and a trim
(rejected drafts); and a stage keeps a cache per session of rank 0's."""

import gc

from mirror_mlx.distributed.pipeline import Sessions
from mirror_mlx.distributed.protocol import FORWARD, Header
from mirror_mlx.distributed.stage import run_stage, session_cache
from mirror_mlx.models import split

import mlx.core as mx
import pytest

from tests.families.tiny import FAMILIES, tiny

# Longer than the tiny models' sliding windows (6 tokens), so windows matter.
PROMPT = [1, 504, 3125, 30, 7382, 281, 260, 3429, 28, 665, 1670, 314, 253, 5728, 30, 1115]


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_is_the_model(family):
    model = tiny(family)
    n = len(model.model.layers)
    tokens = mx.array([PROMPT])
    first, stage, whole = (split.make_cache(model) for _ in range(3))
    for a, b, trim in ((0, 9, 0), (9, 13, 2), (11, 16, 0)):
        p = split.start(model, tokens[:, a:b], first)
        x = split.run_layers(model, p, 0, 2)
        x = run_stage(model, mx.concatenate([x, mx.zeros_like(x)]), stage, 2, n, (2,))
        # Layer 2 is kept: its output travels back beside the last layer's.
        reference, (after3,) = split.forward(model, tokens[:, a:b], whole, taps=(3,))
        assert mx.array_equal(split.final_logits(model, x[:1]), reference), family
        assert mx.array_equal(x[1:], after3), family
        for c in first + stage + whole:
            c.trim(trim)


def test_each_session_has_its_cache_on_the_other_ranks_until_it_is_gone():
    """Rank 0 numbers sessions by their first cache; a request names its session, and once
    a session's cache is collected the next request tells the other ranks to free it."""
    model = tiny("llama")
    sessions, kept = Sessions(), {}
    one, two = split.make_cache(model), split.make_cache(model)
    first = Header(FORWARD, 1, 0, 0, (), *sessions.of(one[0]))
    assert (first.session, first.drop) == (0, -1)
    assert Header.of(first.array()) == first  # as it travels
    assert sessions.of(two[0]) == (1, -1) and sessions.of(one[0]) == (0, -1)
    mine = session_cache(kept, model, first)
    assert session_cache(kept, model, first) is mine
    assert session_cache(kept, model, Header(FORWARD, 1, 0, 0, (), 1)) is not mine
    del one
    gc.collect()
    later = Header(FORWARD, 1, 0, 0, (), *sessions.of(two[0]))
    assert (later.session, later.drop) == (1, 0)
    session_cache(kept, model, later)
    assert sorted(kept) == [1]


def test_the_last_stage_sends_the_exit_ahead_of_the_rest():
    """After layer `early` (Mirror-SD's exit) a stage sends the kept outputs up to it, the
    ones its final message repeats, and then runs on; the header carries the layer."""
    model = tiny("llama")
    n = len(model.model.layers)
    keep, early = (0, 1, n - 2), 1
    header = Header(FORWARD, 9, 0, 0, keep, 3, -1, early)
    assert Header.of(header.array()) == header
    assert header.early_shape(8) == (2, 9, 8)
    p = split.start(model, mx.array([PROMPT[:9]]), split.make_cache(model))
    x = mx.concatenate([p.h] + [mx.zeros_like(p.h)] * len(keep))
    sent = []
    out = run_stage(model, x, split.make_cache(model), 0, n, keep, early, sent.append)
    [ahead] = sent
    assert ahead.shape == (2, 9, p.h.shape[-1])
    assert mx.array_equal(ahead, out[1:3])
    reference, taps = split.forward(model, mx.array([PROMPT[:9]]), split.make_cache(model),
                                    taps=(1, 2, n - 1))
    assert all(mx.array_equal(out[j + 1], taps[j][0]) for j in range(3))
    assert mx.array_equal(split.final_logits(model, out[:1]), reference)
