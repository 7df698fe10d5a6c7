"""The feature-conditioned draft: what training computes is what inference computes, the
training-time test's attention, and drafting that stops by the draft's confidence."""

from mirror_mlx.decode.length import FIRST_THRESHOLD, DraftLength
from mirror_mlx.draft.base import Features, Job
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.train import feature

import mlx.core as mx
import numpy as np
import pytest


@pytest.fixture(scope="module")
def net(target):
    """An untrained feature draft (training is not what these tests are about), head 512."""
    mx.random.seed(0)
    layers = feature.default_feature_layers(target.num_layers)
    return feature.init_feature_draft(target, 1, list(range(512)), layers)


def test_inference_reads_the_features_training_reads(target, net):
    """The draft's first token reads the target's features (pass 0 of the training-time test)
    and its second its own (pass 1): the rollout's distributions equal the training passes'."""
    ids = target.tokenizer.encode("The quick brown fox jumps over the lazy dog because it wants")
    layers = net.config.feature_layers
    n = 10
    drafter = MLXDrafter(net)
    try:
        f = feature.target_features(target, [np.array(ids[:n])], layers)[0].astype(np.float32)
        job = Job([ids[:n]], 2, features=[Features(ids[:n], 0, f[: n - 1])])
        rollout = drafter.submit(job).result().rollouts[0]
    finally:
        drafter.close()
    seq = ids[:n] + rollout.tokens[:1]
    f = feature.target_features(target, [np.array(seq)], layers)[0]
    passes = feature.unrolled_logits(net, mx.array([seq]), mx.array(f[None]), 2)
    for k, at in ((0, n - 1), (1, n)):
        p = np.array(mx.softmax(passes[k][0, at].astype(mx.float32)))
        top = np.argsort(-p)[: rollout.top_ids.shape[1]]
        assert rollout.top_ids[k].tolist() == np.array(net.head_ids)[top].tolist()
        np.testing.assert_allclose(rollout.top_probs[k], p[top], rtol=2e-3, atol=1e-5)


def test_the_unrolled_passes_attend_as_drafted_tokens_do():
    # Pass 2 at t = 3: the target-fed keys up to 1, pass 1's key at 2, its own at 3.
    mask = np.array(feature._unroll_mask(5, 2))[0, 0]
    assert mask.shape == (5, 15)
    assert mask[3].nonzero()[0].tolist() == [0, 1, 5 + 2, 10 + 3]
    assert mask[0].nonzero()[0].tolist() == [10]  # nothing drafted before position 0


def test_drafting_stops_where_confidence_falls_below_the_threshold(target, net):
    ids = target.tokenizer.encode("Name three colors:")
    layers = net.config.feature_layers
    f = feature.target_features(target, [np.array(ids)], layers)[0].astype(np.float32)
    drafter = MLXDrafter(net)
    try:
        full = drafter.submit(Job([ids], 4, features=[Features(ids, 0, f[:-1])])).result()
        none = drafter.submit(Job([ids], 4, min_confidence=1.01)).result()
    finally:
        drafter.close()
    assert len(full.rollouts[0].tokens) == 4 and not full.rollouts[0].ended
    assert none.rollouts[0].tokens == [] and none.rollouts[0].ended
    assert none.rollouts[0].top_ids.shape == (0, full.rollouts[0].top_ids.shape[1])


def test_the_length_threshold_follows_the_measured_costs():
    length = DraftLength()
    assert length.threshold() == FIRST_THRESHOLD  # nothing measured yet
    length.record_target(0.100, 0)
    length.record_target(0.110, 4)
    length.record_draft(0.010, 2)
    # t_1 = 0.100, each drafted token adds 0.0025 to verification and costs 0.005 to draft.
    assert length.threshold() == pytest.approx((0.005 + 0.0025) / 0.100)
    length.record_draft(10.0, 1)  # a draft far slower than the target: nothing pays
    assert length.threshold() == 0.95
    assert length.chosen == {0: 1, 4: 1}


def test_a_copy_only_job_needs_no_worker_and_its_features_reach_the_next_job(target, net):
    """A step that does not draft costs the decoder no trip to the draft's worker (answered
    at submit), and the features it brings are read by the next job as if sent with it."""
    ids = target.tokenizer.encode("The quick brown fox jumps over the lazy dog because it wants")
    f = feature.target_features(target, [np.array(ids)], net.config.feature_layers)[0]
    f = f.astype(np.float32)
    n = 8
    rollouts = []
    for pause in (False, True):
        drafter = MLXDrafter(net)
        try:
            drafter.submit(Job([ids[:n]], 0, features=[Features(ids[:n], 0, f[: n - 1])]))
            late = [Features(ids, n - 1, f[n - 1 : -1])]
            if pause:
                paused = drafter.submit(Job([ids], 3, features=late, copy_only=True))
                assert paused.done()
                assert paused.result().rollouts[0].tokens == [] \
                    and paused.result().rollouts[0].ended
                late = []
            rollouts.append(drafter.submit(Job([ids], 3, features=late)).result().rollouts[0])
        finally:
            drafter.close()
    assert rollouts[1].tokens == rollouts[0].tokens
    np.testing.assert_array_equal(rollouts[1].top_ids, rollouts[0].top_ids)
