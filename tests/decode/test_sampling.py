"""The sampling distribution's filters and the sampler, against exact expectations."""

from mirror_mlx.decode.sampling import Sampler, SamplingParams, distribution

import mlx.core as mx
import numpy as np

LOGITS = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_only_is_softmax():
    p = np.array(distribution(LOGITS, SamplingParams(temperature=0.7)))[0]
    np.testing.assert_allclose(p, softmax(np.array(LOGITS)[0] / 0.7), rtol=1e-5)


def test_top_k_keeps_k_largest():
    p = np.array(distribution(LOGITS, SamplingParams(temperature=1.0, top_k=2)))[0]
    assert (p[2:] == 0).all()
    np.testing.assert_allclose(p[:2], softmax(np.array([2.0, 1.0])), rtol=1e-5)


def test_top_p_keeps_smallest_head_reaching_p():
    full = softmax(np.array(LOGITS)[0])
    # The first two tokens hold < 0.8 of the mass, the first three >= 0.8: keep three.
    assert full[:2].sum() < 0.8 <= full[:3].sum()
    p = np.array(distribution(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)))[0]
    assert (p[3:] == 0).all() and (p[:3] > 0).all()
    np.testing.assert_allclose(p[:3], full[:3] / full[:3].sum(), rtol=1e-5)


def test_min_p_drops_tokens_below_fraction_of_max():
    full = softmax(np.array(LOGITS)[0])
    p = np.array(distribution(LOGITS, SamplingParams(temperature=1.0, min_p=0.2)))[0]
    keep = full >= 0.2 * full.max()
    assert ((p > 0) == keep).all()


def test_sampler_frequencies_match_probabilities():
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    n = 40_000
    counts = np.bincount([sampler.draw(probs) for _ in range(n)], minlength=len(probs))
    assert counts[-1] == 0
    expected = probs[:-1] * n
    chi2 = (((counts[:-1] - expected) ** 2) / expected).sum()
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001
