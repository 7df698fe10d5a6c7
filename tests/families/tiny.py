"""Tiny random-weight models of each family mlx-lm loads that mirror-mlx runs, built from
mlx-lm's own model classes, with the default model's vocabulary size (its tokenizer serves)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

VOCAB = 49152  # the default model's
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
              max_position_embeddings=4096)

# name -> (mlx-lm module, config): each family, and the rope scalings, qk-norm, fused qkv,
# sliding windows and soft-capping they bring. Windows are short, so prompts cross them.
FAMILIES = {
    "llama": ("llama", dict(model_type="llama", tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(
        model_type="llama", tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-sliding": ("llama", dict(
        model_type="llama", tie_word_embeddings=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    "mistral-yarn": ("llama", dict(
        model_type="mistral", tie_word_embeddings=False, rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("qwen2", dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("qwen3", dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True,
                            rope_theta=1e6)),
    "phi3": ("phi3", dict(model_type="phi3", partial_rotary_factor=0.5,
                          original_max_position_embeddings=4096,
                          rope_scaling={"type": "longrope", "short_factor": [1.0] * 4,
                                        "long_factor": [1.0, 2.0, 4.0, 8.0]})),
    "gemma2": ("gemma2", dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16)),
    "gemma3_text": ("gemma3_text", dict(model_type="gemma3_text", head_dim=16,
                                        query_pre_attn_scalar=16, sliding_window=6,
                                        sliding_window_pattern=2, rope_theta=1e6)),
}


def config(family: str, layers: int = 4) -> dict:
    return {**COMMON, **FAMILIES[family][1], "num_hidden_layers": layers}


def tiny(family: str, layers: int = 4, seed: int = 0) -> nn.Module:
    """A random model of `family`. Weights are scaled up from the default initialisation so
    that the next-token distributions are peaked: greedy choices then have clear margins, and
    differences in the order of float operations between decoders cannot flip them."""
    module = importlib.import_module(f"mlx_lm.models.{FAMILIES[family][0]}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config(family, layers)))
    model.update(tree_map(lambda w: w * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def save(model: nn.Module, family: str, folder: Path, tokenizer,
         settings: dict | None = None) -> Path:
    """Write `model` as an mlx-lm model folder with `tokenizer`'s files; `settings`: its
    config.json when not the family's."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = settings or config(family, len(model.layers))
    (folder / "config.json").write_text(json.dumps(settings))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tokenizer.save_pretrained(str(folder))
    return folder
