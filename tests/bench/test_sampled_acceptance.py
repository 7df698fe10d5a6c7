"""benchmarks/sampled_acceptance.py: a draft that is the target is accepted with certainty at
every position; one that differs, or the target's own draft at another temperature, is not."""

import importlib.util
from pathlib import Path

from mirror_mlx.draft.load import load_draft

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sampled_acceptance.py"


def test_acceptance_is_certain_only_for_the_target_itself(target):
    spec = importlib.util.spec_from_file_location("sampled_acceptance", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompt = target.tokenizer.encode("The capital of France is")
    reply = target.tokenizer.encode(" Paris, a city on the Seine with many museums.")
    gamma = 3
    same = script.overlaps(target, load_draft(f"self:{target.num_layers}", target), prompt,
                           reply, 1.0, [1.0, 0.5], gamma)
    assert same.shape == (2, gamma, len(reply))
    # The draft's path sums the vocabulary in another order: 4e-5 from 1 here; a sharper q
    # gives 0.57 at the least, and another draft 0.54 at the most.
    np.testing.assert_allclose(same[0], 1.0, atol=1e-3)
    assert (same[1] < 0.999).any()  # a sharper q than p is not p
    # Every position's window is accepted whole: gamma tokens and the target's own, or as
    # many as the reply has left.
    n = len(reply)
    expected = sum(min(gamma + 1, n - t) for t in range(n))
    assert abs(script.tokens_per_step(same[0]) - expected) < 1e-3 * gamma * n
    other = script.overlaps(target, load_draft("self:2", target), prompt, reply, 1.0, [1.0],
                            gamma)[0]
    assert ((other > 0) & (other < 0.999)).all()
    assert script.tokens_per_step(other) < expected
