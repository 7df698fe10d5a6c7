"""Drafts of the families Mac users run, exported to Core ML: the package's module (through the
reference executor, under the package's exact contract) against the MLX draft, on the calls of
test_parity's scenario (a prefill split in calls, steps, a tree-masked batch, moved slots), past
the tiny models' sliding windows. Each draft is a whole tiny random model of mlx-lm's own class
(tests/families/tiny.py), 128 wide so that head_dim is 32, the size the Neural Engine's states
need.

Two checks per draft. With the cache unrounded (float32 state), the module computes what the
MLX draft does up to float32 rounding (measured: at most 1e-4 for logits up to ~21): this
holds each family's layout to the model. With the package's fp16 cache, the best token agrees
everywhere and the logits move by the cache's rounding, which these peaked random models
amplify (measured: up to 1.2% of the largest |logit|, gemma 3; 0.5% for the others; 0.25% for
gemma 2, whose logits are capped at 8 here).
"""

import importlib

from mirror_mlx.draft.coreml_draft import CoreMLExecutor, mlx_embedding
from mirror_mlx.draft.coreml_package import WINDOW_INPUT
from mirror_mlx.draft.mlx_draft import MLXExecutor
from mirror_mlx.draft.net import DraftNet

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_map

from coreml_export.convert import package_spec
from coreml_export.reference import ReferenceModel
from tests.coreml.test_parity import scenario
from tests.families.tiny import FAMILIES, config
from tests.prompts import PROMPTS

WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)
# name -> (tiny.py family, what differs from it)
DRAFTS = {
    "llama3-rope": ("llama3-rope", {}),
    "llama-linear-rope": ("llama", dict(rope_scaling={"type": "linear", "factor": 4.0})),
    "mistral-yarn": ("mistral-yarn", dict(rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 2.0})),
    "llama-sliding": ("llama-sliding", {}),
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "gemma3_text": ("gemma3_text", {}),
    "gemma2": ("gemma2", dict(attn_logit_softcapping=2.0, final_logit_softcapping=8.0)),
}


def tiny_draft(name: str, seed: int = 0) -> DraftNet:
    family, extra = DRAFTS[name]
    module = importlib.import_module(f"mlx_lm.models.{FAMILIES[family][0]}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({**config(family, 2), **WIDE, **extra}))
    model.update(tree_map(lambda w: w * 2.0, model.parameters()))  # peaked, as tiny.py's
    mx.eval(model.parameters())
    return DraftNet.from_model(model)


def within(relative: float):
    def check(a: np.ndarray, b: np.ndarray) -> None:
        diff, largest = float(np.abs(a - b).max()), float(np.abs(a).max())
        print(f"max |logit difference| {diff:.4f}, largest |logit| {largest:.1f}")
        assert diff <= relative * largest, (diff, largest)
        assert (a.argmax(-1) == b.argmax(-1)).all()
    return check


@pytest.mark.parametrize("name", DRAFTS)
def test_family_draft_matches_mlx(name, target):
    net = tiny_draft(name)
    spec, weights = package_spec(net, 256, 8)
    windowed = name in ("llama-sliding", "gemma3_text")
    assert (WINDOW_INPUT in spec.inputs) == windowed
    assert len(spec.form.rope_freqs) == (2 if name == "gemma3_text" else 1)
    for state, relative in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        reference = ReferenceModel(spec, weights, state_dtype=state)
        pair = MLXExecutor(net), CoreMLExecutor(reference, spec, mlx_embedding(net.embed_tokens))
        scenario(*pair, target.tokenizer, within(relative))


def test_gemma_stream_past_float16(target):
    """Gemma's residual stream outgrows float16 (large post-norm weights: Gemma 3 270M's passes
    65,504 from its 8th layer). The package carries it scaled down: no module's output leaves
    float16's range where the MLX draft's stream passes it, and the logits are the same."""
    net = tiny_draft("gemma3_text")
    for layer in net.layers:
        norm = layer.post_feedforward_layernorm
        norm.weight = mx.full(norm.weight.shape, 4e4)  # within float16 itself
    tokens = target.tokenizer.encode(PROMPTS[0])
    assert float(mx.abs(net.top(mx.array([tokens]), 0, "causal")).max()) > 65504
    spec, weights = package_spec(net, 256, 8)
    reference = ReferenceModel(spec, weights, state_dtype=torch.float32)
    largest = []
    for module in reference.module.modules():
        module.register_forward_hook(lambda m, i, out: largest.append(max(
            float(o.abs().max()) for o in (out if isinstance(out, tuple) else (out,)))))
    pair = MLXExecutor(net), CoreMLExecutor(reference, spec, mlx_embedding(net.embed_tokens))
    within(1e-4)(*[ex.forward(tokens, 0, None, [len(tokens) - 1]) for ex in pair])
    assert 0 < max(largest) < 65504 / 8
