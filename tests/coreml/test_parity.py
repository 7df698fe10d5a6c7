"""The ANE-layout PyTorch module (run by the reference executor, under the package's exact
input/output/state contract) against the MLX draft, on real tokens: one token, several tokens,
a tree-masked batch of branches, and after KV slots are moved.

Tolerance: the module keeps its KV cache in fp16, as the package does; the MLX draft keeps
float32. Measured here (pytest -s prints it): max |logit difference| 0.0064 for self:2, whose
logits reach ~70, and 0.0005 for the small draft (logits up to ~3). The bound,
2e-3 + 2e-4 x the largest |logit|, leaves 2.5x and 5x room; the best token must agree everywhere.
"""

from mirror_mlx.draft.coreml_draft import CoreMLExecutor, mlx_embedding
from mirror_mlx.draft.coreml_package import draft_weights, query_sizes
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.mlx_draft import MLXExecutor
from mirror_mlx.draft.net import DraftNet
from mirror_mlx.draft.rollout import FED, OWN, TARGET, ZERO, FeatureRefs
from mirror_mlx.train.feature import target_features

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from coreml_export.convert import package_spec
from coreml_export.reference import ReferenceModel
from tests.prompts import PROMPTS


def close(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and a.size
    diff = float(np.abs(a - b).max())
    print(f"max |logit difference| {diff:.4f}, largest |logit| {np.abs(a).max():.1f}")
    assert diff <= 2e-3 + 2e-4 * float(np.abs(a).max()), diff
    assert (a.argmax(-1) == b.argmax(-1)).all()
    return diff


def executors(net, context=256, max_branch_tokens=8):
    spec, weights = package_spec(net, context, max_branch_tokens)
    embed = mlx_embedding(net.embed_tokens)
    return MLXExecutor(net), CoreMLExecutor(ReferenceModel(spec, weights), spec, embed)


def with_qkv_bias(net: DraftNet) -> DraftNet:
    """The small draft with biases on q, k and v (as Qwen2 drafts have)."""
    copy = DraftNet(net.config)
    copy.update(net.parameters())
    for layer in copy.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(layer.self_attn, name)
            new = nn.Linear(old.weight.shape[1], old.weight.shape[0], bias=True)
            new.weight = old.weight
            setattr(layer.self_attn, name, new)
    return copy


@pytest.fixture(scope="module", params=["self:2", "small", "small+bias"])
def pair(request, target, small_draft):
    if request.param == "self:2":
        return executors(load_draft(request.param, target))
    return executors(small_draft if request.param == "small" else with_qkv_bias(small_draft))


def test_logits_match_mlx(target, pair):
    scenario(*pair, target.tokenizer, close)


def scenario(mlx_ex, other, tok, check) -> None:
    """The same calls on two executors, comparing logits with `check`."""
    C = tok.encode(PROMPTS[0] + " " + PROMPTS[1])  # > 8 tokens: the prefill is split in calls
    pair = (mlx_ex, other)
    for ex in pair:
        ex.truncate(0)
        assert ex.forward(C, 0, None, []).size == 0
    both = lambda *args: [ex.forward(*args) for ex in pair]  # noqa: E731

    # One token, then several (causal, contiguous positions), then more than one call holds.
    check(*both([C[-1]], len(C), None, [0]))
    more = tok.encode(" The answer is simple and short, as far as I know.")
    n = len(C) + 1
    check(*both(more[:5], n, None, list(range(5))))
    check(*both(more[5:], n + 5, None, list(range(len(more) - 5))))
    n += len(more)

    # A tree-masked batch: three branches hanging off the trunk at different depths, with
    # explicit positions, fed together (as the rollout lays them out).
    starts, branch = [n - 3, n - 1, n], [tok.encode(w) for w in (" red", " two green", " blue")]
    tokens, positions, mask_rows, slots = [], [], [], []
    size = n
    for start, toks in zip(starts, branch):
        mine = []
        for j, t in enumerate(toks):
            mine.append(size)
            row = np.zeros(n + sum(map(len, branch)), bool)
            row[:start] = True
            row[mine] = True
            tokens.append(t)
            positions.append(start + j)
            mask_rows.append(row)
            slots.append(list(mine))
            size += 1
    check(*both(tokens, positions, np.array(mask_rows), list(range(len(tokens)))))

    # The second branch becomes the main line: its slots move to where it leaves the trunk.
    second = slots[len(branch[0]) + len(branch[1]) - 1]
    for ex in pair:
        ex.gather(starts[1], second)
    check(*both([5], starts[1] + len(second), None, [0]))


def test_feature_draft_matches_mlx(target):
    """The shipped draft reads the target's hidden states: the package takes them (and its own
    outputs, fed back by the host) as inputs. Every kind of feature a rollout feeds, through
    calls the package must split: the target's over a long prefill, the draft's own output
    chained within one call, a slot's earlier feature fed again, and after slots move."""
    net = load_draft("default", target)
    assert net.reads_features
    feature_scenario(net, *executors(net), target, close)


def feature_scenario(net, mlx_ex, ref, target, check, own_relative: float = 1e-2) -> None:
    """The same feature-fed calls on the MLX executor and a package's, comparing logits with
    `check`, and the drafts' own outputs within `own_relative` of their largest."""
    pair = (mlx_ex, ref)
    C = target.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    n = len(C)
    rows = target_features(target, [np.array(C)], net.config.feature_layers)[0]
    rows = rows.astype(np.float32)

    def both(tokens, positions, mask, out_rows, kinds, refs, target_rows=()):
        features = FeatureRefs(list(kinds), list(refs), [rows[i] for i in target_rows])
        return [ex.forward(tokens, positions, mask, out_rows, features) for ex in pair]

    # The prompt: token p reads the target's features after p - 1 (none for the first).
    check(*both(C, 0, None, [n - 1], [ZERO] + [TARGET] * (n - 1), [0, *range(n - 1)],
                 range(n - 1)))
    # Three drafted tokens in one call, each reading the draft's own output before it.
    check(*both([11, 12, 13], n, None, [0, 1, 2], [OWN] * 3, [n - 1, n, n + 1]))
    # A token fed again at a new slot, with what slot n - 2 was fed (the target's features).
    check(*both([C[-2]], n + 3, None, [0], [FED], [n - 2]))
    # The drafted tokens' slots move back beside the prompt; a token reads the last one's own.
    for ex in pair:
        ex.gather(n, [n, n + 1])
    check(*both([14], n + 2, None, [0], [OWN], [n + 1]))
    size = n + 3
    mine = np.array(mlx_ex.own[:size])
    assert np.abs(mine - ref.own[:size]).max() <= own_relative * np.abs(mine).max()


class Recording:
    """A runtime that keeps the largest |target feature| it was given."""

    def __init__(self, runtime):
        self.runtime, self.largest = runtime, 0.0

    def make_state(self):
        return self.runtime.make_state()

    def predict(self, inputs, state):
        self.largest = max(self.largest, float(np.abs(inputs["target_features"]).max()))
        return self.runtime.predict(inputs, state)


def test_feature_draft_takes_states_past_float16(target):
    """Gemma's hidden states pass float16's 65,504: the host divides each by its RMS before it
    enters the package (which reads it through an RMS norm), so what the float16 package is
    given fits, and the logits are those of the MLX draft fed the raw states."""
    net = load_draft("default", target)
    spec, weights = package_spec(net, 256, 8)
    runtime = Recording(ReferenceModel(spec, weights))
    pair = MLXExecutor(net), CoreMLExecutor(runtime, spec, mlx_embedding(net.embed_tokens))
    C = target.tokenizer.encode(PROMPTS[0])
    n = len(C)
    rows = target_features(target, [np.array(C)], net.config.feature_layers)[0]
    parts = len(net.config.feature_layers)
    scale = np.repeat([3e5, 1.0, 2e6][:parts], net.config.feature_size).astype(np.float32)
    rows = rows.astype(np.float32) * scale
    assert np.abs(rows).max() > 65504
    features = FeatureRefs([ZERO] + [TARGET] * (n - 1), [0, *range(n - 1)],
                           [rows[i] for i in range(n - 1)])
    close(*[ex.forward(C, 0, None, [n - 1], features) for ex in pair])
    assert 1.0 < runtime.largest <= np.sqrt(net.config.feature_size)


def test_query_sizes():
    assert query_sizes(1) == (1,)
    assert query_sizes(8) == (1, 2, 4, 8)
    assert query_sizes(24) == (1, 2, 4, 8, 16, 24)


def test_draft_weights_dequantize(small_draft):
    """A quantized draft's weights go into the package dequantized, equal to what MLX
    computes with."""
    net = DraftNet(small_draft.config)  # its own weights: quantizing must not touch others
    dense = draft_weights(net)
    nn.quantize(net.layers[0].mlp, group_size=32, bits=8)
    w = draft_weights(net)["layers.0.mlp.up_proj.weight"]
    assert 0 < np.abs(w - dense["layers.0.mlp.up_proj.weight"]).max() < 0.01
    x = np.random.default_rng(0).standard_normal((3, w.shape[1])).astype(np.float32)
    expected = np.array(net.layers[0].mlp.up_proj(mx.array(x)))
    assert np.abs(x @ w.T - expected).max() < 1e-4
