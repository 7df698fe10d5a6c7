"""Lossless, greedy: speculative and Mirror-SD output equals target-only greedy output,
token for token, on real prompts with the real default target and the shipped drafts (the
default, which reads the target's features, and the one that reads tokens only), with fixed and
adaptive window lengths, drafting by prompt lookup where the context allows (the default) and
with the draft network only."""

from mirror_mlx.api import Engine

import pytest

from tests.prompts import PROMPTS

MAX_TOKENS = 24

# Each configuration exercises other paths: window sizes, branch budgets and sources.
CONFIGS = [
    dict(mode="sd", gamma=3),
    dict(mode="sd"),  # the adaptive length
    dict(mode="mirror", gamma=5, kappa=8, branch_budget=4, branch_source="union"),
    dict(mode="mirror", gamma=3, kappa=4, branch_budget=2, branch_source="exit"),
    dict(mode="mirror", gamma=6, kappa=8, branch_budget=0, draft="default-tokens"),
    # Exit below the draft's feature layers: the branches draft on the draft's own features.
    dict(mode="mirror", gamma=4, kappa=8, branch_budget=3, branch_source="draft",
         exit_layer=20),
    dict(mode="sd", gamma=5, lookup=False, draft="default-tokens"),
    dict(mode="mirror", kappa=8, branch_budget=4, lookup=False),
    dict(mode="mirror"),  # the automatic budget and length
]


@pytest.fixture(scope="module")
def reference(target):
    engine = Engine(target, mode="ar")
    return {p: engine.generate(p, max_tokens=MAX_TOKENS).token_ids for p in PROMPTS[:6]}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_speculative_greedy_equals_autoregressive(target, reference, config):
    prompts = PROMPTS[:6] if config in CONFIGS[:1] + CONFIGS[2:3] else PROMPTS[:3]
    with Engine(target, **config) as engine:
        for prompt in prompts:
            engine.session.reset()
            result = engine.generate(prompt, max_tokens=MAX_TOKENS)
            assert result.token_ids == reference[prompt], (config, prompt)
            assert result.stats.target_steps <= len(result.token_ids) + 1  # + the EOS step
        copies = getattr(engine.drafter, "copies", None)
        assert copies is None if config.get("lookup") is False else copies > 0
