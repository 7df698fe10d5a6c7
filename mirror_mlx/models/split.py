"""The target's forward pass split at an exit layer, and the early-exit readout.

`prefix` + `suffix` computes exactly what mlx-lm's own forward computes (same modules, same
masks), so verification through the split is the target itself. The exit readout turns the
hidden state after layer l_e into top-kappa token guesses: optionally through a trained exit
head (a tuned lens: one linear map), then the shared final norm and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..errors import ModelLoadError
from .load import check_weights

# The families whose forward this module reproduces layer by layer. Besides the llama layout
# (model.model.embed_tokens / layers / norm, each layer called as layer(h, mask, cache)), each
# may scale its embeddings, give some layers a sliding window, and soft-cap its logits: see
# `embed_scale`, `layer_windows` and `soft_cap`, which follow each family's Model.__call__
# in mlx-lm. "mistral" is mlx-lm's llama under another name.
SPLIT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


def splittable(model: nn.Module) -> bool:
    return getattr(model, "model_type", None) in SPLIT_MODEL_TYPES and all(
        hasattr(getattr(model, "model", None), a) for a in ("embed_tokens", "layers", "norm"))


def check_splittable(model: nn.Module) -> None:
    if not splittable(model):
        raise ModelLoadError(
            f"Mirror-SD runs the target's layers one by one, which needs to know how its family "
            f"embeds tokens, masks each layer and reads out logits; model type "
            f"'{getattr(model, 'model_type', '?')}' is not among the families that "
            f"mirror_mlx/models/split.py knows ({', '.join(SPLIT_MODEL_TYPES)})")


def embed_scale(model: nn.Module) -> mx.array | None:
    """What the family multiplies token embeddings by (None: nothing). Gemma scales by
    sqrt(hidden); Gemma 3 rounds that factor to bfloat16 first, as mlx-lm does."""
    kind = getattr(model, "model_type", None)
    if kind == "gemma3_text":
        return mx.array(model.args.hidden_size**0.5, mx.bfloat16)
    if kind == "gemma2":
        return mx.array(model.args.hidden_size**0.5)
    return None


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding attention window (None: it attends to everything)."""
    window = getattr(model.args, "sliding_window", None)
    return [window if getattr(layer, "use_sliding", False)  # llama's layer_types
            or getattr(layer.self_attn, "is_sliding", False) else None  # gemma 3
            for layer in model.model.layers]


def make_cache(model: nn.Module) -> list:
    """A cache for the target: one that keeps every key for the families of this module, whose
    masks then apply the sliding windows (a rotating cache can't take back rejected tokens
    once it has wrapped around), else mlx-lm's own."""
    if splittable(model):
        return [KVCache() for _ in model.model.layers]
    return make_prompt_cache(model)


@dataclass
class Pass:
    """One verification forward in progress: hidden state, masks and where it stands.
    `taps`: after how many layers to keep the hidden state (a feature-conditioned draft's
    `feature_layers`), kept in `features` in that order."""

    h: mx.array
    masks: list  # one per layer
    cache: list
    taps: tuple[int, ...] = ()
    features: list = field(default_factory=list)


def start(model: nn.Module, tokens: mx.array, cache: list, taps=()) -> Pass:
    check_splittable(model)
    h = model.model.embed_tokens(tokens)
    scale = embed_scale(model)
    if scale is not None:
        h = h * scale.astype(h.dtype)
    return Pass(h, layer_masks(model, h, cache), cache, tuple(taps))


def layer_masks(model: nn.Module, h: mx.array, cache: list, begin: int = 0,
                end: int | None = None) -> list:
    """The masks of layers [begin, end) for the window `h`. As the families' own forward:
    one mask per window, made from the cache of the first of these layers with that window
    (gemma 2 wants masks as arrays)."""
    array = model.model_type == "gemma2"
    made: dict = {}
    masks = []
    for i, window in enumerate(layer_windows(model)[begin:end], start=begin):
        if window not in made:
            made[window] = create_attention_mask(h, cache[i], window_size=window,
                                                 return_array=array)
        masks.append(made[window])
    return masks


def run_layers(model: nn.Module, p: Pass, begin: int, end: int) -> mx.array:
    layers = model.model.layers
    for i in range(begin, end):
        p.h = layers[i](p.h, p.masks[i], cache=p.cache[i])
        if i + 1 in p.taps:
            p.features.append(p.h)
    return p.h


def forward(model: nn.Module, tokens: mx.array, cache: list, taps=()
            ) -> tuple[mx.array, list[mx.array]]:
    """The target's whole forward (what `model(tokens, cache=cache)` computes, logits (B, T,
    V)), plus its hidden states after the layers in `taps`: one pass serves verification and
    the draft's features. A family this module does not know runs as itself (no taps)."""
    if not taps and not splittable(model):
        return model(tokens, cache=cache), []
    p = start(model, tokens, cache, taps)
    run_layers(model, p, 0, len(model.model.layers))
    return final_logits(model, p.h), p.features


def lm_head(model: nn.Module, h: mx.array) -> mx.array:
    """Logits from a final-normed hidden state, through the target's own output layer."""
    if hasattr(model, "lm_head"):
        return soft_cap(model, model.lm_head(h))
    return soft_cap(model, model.model.embed_tokens.as_linear(h))


def soft_cap(model: nn.Module, logits: mx.array) -> mx.array:
    """Gemma 2's final logit soft-capping (the identity for the other families)."""
    cap = getattr(model, "final_logit_softcapping", None)
    return logits if not cap else mx.tanh(logits / cap) * cap


def final_logits(model: nn.Module, h: mx.array) -> mx.array:
    return lm_head(model, model.model.norm(h))


class ExitHead(nn.Module):
    """Tuned lens at layer `layer`: h -> h + W h + b before the shared final norm and LM head
    (zero W, b is the raw logit lens)."""

    def __init__(self, layer: int, hidden: int):
        super().__init__()
        self.layer = layer
        self.proj = nn.Linear(hidden, hidden)
        self.proj.weight = mx.zeros((hidden, hidden))
        self.proj.bias = mx.zeros((hidden,))

    def save(self, path: str | Path) -> None:
        mx.save_safetensors(str(path), {"weight": self.proj.weight, "bias": self.proj.bias},
                            metadata={"layer": str(self.layer), "format": "mirror-mlx-exit"})

    @staticmethod
    def load(path: str | Path, hidden: int, num_layers: int) -> ExitHead:
        try:
            tensors, meta = mx.load(str(path), return_metadata=True)
            layer = int(meta["layer"])
            weight, bias = tensors["weight"], tensors["bias"]
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: not an exit head file ({e})") from e
        if weight.shape != (hidden, hidden) or bias.shape != (hidden,):
            raise ModelLoadError(f"{path}: exit head is for hidden size {weight.shape[-1]}, "
                                 f"the target's is {hidden}")
        if not 0 < layer < num_layers:
            raise ModelLoadError(f"{path}: exit layer {layer} is outside 1..{num_layers - 1}")
        if set(tensors) != {"weight", "bias"}:
            raise ModelLoadError(f"{path}: an exit head holds a weight and a bias, not "
                                 f"{sorted(tensors)}")
        check_weights([("weight", weight), ("bias", bias)], str(path))
        head = ExitHead(layer, hidden)
        head.proj.weight, head.proj.bias = weight.astype(mx.float32), bias.astype(mx.float32)
        # Evaluated here: a lazy array belongs to this thread's stream, and decoding may run in
        # another thread (a server's request handler), where that stream does not exist.
        mx.eval(head.parameters())
        return head


@dataclass
class ExitVocab:
    """The early exit's reduced output layer: the LM head's rows for `ids` only. The full head
    is about a fifth of a small target's weights; reading the exit through it at every window
    position each step would cost that much again, while the branches only need the likely
    tokens, and a draft can only continue from tokens its own head knows best anyway."""

    ids: mx.array  # (n,) token ids
    weight: mx.array  # (n, hidden) their output rows, dense

    @staticmethod
    def of(model: nn.Module, ids) -> ExitVocab:
        ids = mx.array(ids, dtype=mx.int32)
        out = getattr(model, "lm_head", None) or model.model.embed_tokens
        if hasattr(out, "scales"):  # quantized: dequantize just the rows read out
            rows = mx.dequantize(out.weight[ids], out.scales[ids], out.biases[ids],
                                 group_size=out.group_size, bits=out.bits)
        else:
            rows = out.weight[ids]
        vocab = ExitVocab(ids, rows.astype(model.model.norm.weight.dtype))
        mx.eval(vocab.ids, vocab.weight)  # see ExitHead.load: decoding may run in another thread
        return vocab

    def with_tokens(self, model: nn.Module, tokens) -> ExitVocab:
        """This vocabulary and `tokens` (a prompt's): replies quote their prompt, names and
        numbers included, which a frequency-chosen list misses."""
        return ExitVocab.of(model, np.union1d(np.array(self.ids), np.asarray(tokens)))


def exit_logits(model: nn.Module, h: mx.array, head: ExitHead | None,
                vocab: ExitVocab | None = None) -> mx.array:
    """Early-exit logits at every position of `h` (the raw logit lens when `head` is None),
    over `vocab.ids` when a reduced vocabulary is given, else over the whole vocabulary."""
    if head is not None:
        h = h + head.proj(h)
    h = model.model.norm(h)
    return lm_head(model, h) if vocab is None else soft_cap(model, h @ vocab.weight.T)


def exit_top_k(model: nn.Module, h: mx.array, head: ExitHead | None, vocab: ExitVocab | None,
               k: int) -> tuple[mx.array, mx.array]:
    """The exit's top-k token ids and log-probabilities (within its vocabulary) per position."""
    ids, logp = top_k(exit_logits(model, h, head, vocab), k)
    return (ids if vocab is None else vocab.ids[ids]), logp


def top_k(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Top-k ids and log-probabilities along the last axis, best first."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.argpartition(-logp, kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
