"""Published EAGLE-3 heads as drafts: a folder of config.json and weights, in the layout of
SafeAILab's EAGLE and SGLang's SpecForge (`midlayer.*`) or of vLLM's speculators (`layers.N.*`,
architecture Eagle3Speculator), made into a DraftNet that the SD and Mirror-SD paths run as
they run the project's own feature drafts (net.py).

What a head computes, per token t (EAGLE's cnets.py, SpecForge's llama3_eagle.py, speculators'
eagle3 model): its first layer's attention reads [input_layernorm(embedding of t),
hidden_norm(g)], 2 * hidden wide, and its residual stream starts from g itself (from
hidden_norm(g) with speculators' norm_before_residual); later layers are plain llama layers.
g is the target's hidden states after t - 1 at three layers, concatenated and mapped by `fc`
(optionally normed first: SpecForge's and speculators' `fc_norm` per layer, speculators'
`norm_before_fc` over the whole), or, where the target has not run yet, the head's own last
output at t - 1 before its final norm (after it with speculators' `norm_output`): `fc` never
sees those. The final norm and `lm_head` score `draft_vocab_size` tokens; head index i is
token i + d2t[i].

EAGLE feeds the pair (features after t - 1, token t) from t = 1: the first token never enters
the head. Here every position enters the draft's cache, the first with no features, so the
head's attention hides that slot from every later token (`_without_first`). RoPE is relative,
so EAGLE's positions, one less than the token's, change nothing.

Which target states are fused ("taps": after how many target layers, as models/split.py counts
them): EAGLE captures the inputs of layers 2, N // 2 and N - 3 (0-based), the same states
SpecForge names as the outputs of layers 1, N // 2 - 1 and N - 4, so taps 2, N // 2, N - 3 by
default. An explicit list is read in the convention of where it is written: SpecForge and
SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` name layer outputs (tap = id + 1);
vLLM's top-level `eagle_aux_hidden_state_layer_ids` names layer inputs (tap = id).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, initialize_rope

from ..errors import IncompatibleDraft, MissingExtra, ModelLoadError
from ..models.load import LoadedModel, resolve_dtype
from ..models.split import check_splittable
from .net import Block, DraftConfig, DraftNet

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
LAYER_TYPES = ("llama", "qwen3")  # speculators' first-layer kinds (qwen3: qk-norm)
# Tensors a head file may hold that inference does not read: the verifier's own head and norm
# (speculators' training copies) and rope tables.
IGNORED = ("verifier_lm_head.", "verifier_norm.", "rotary_emb.")


@dataclass
class HeadConfig:
    """What a head's config.json says, in either layout (defaults: transformers' llama)."""

    draft: DraftConfig  # its layers, without what depends on the target
    draft_vocab_size: int
    target_hidden: int
    aux_ids: list[int] | None  # explicit fused layers as written
    aux_are_outputs: bool  # the ids name layer outputs (SpecForge) rather than inputs (vLLM)
    rope_scaling: dict | None
    max_positions: int | None
    qk_norm: bool
    attention_bias: bool
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    feed_normed: bool = False  # speculators' norm_output: its own features are post-norm
    norm_before_head: bool = True  # SpecForge's norm_output


def is_eagle3_folder(folder: Path) -> bool:
    """A folder whose config.json describes an EAGLE-3 head. A head published as plain
    LlamaForCausalLM is told from a llama model by its draft vocabulary and single layer."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    return (cfg.get("speculators_model_type") == "eagle3"
            or bool(set(cfg.get("architectures") or ()) & set(ARCHITECTURES))
            or ("draft_vocab_size" in cfg and cfg.get("num_hidden_layers") == 1))


def read_config(folder: Path) -> HeadConfig:
    try:
        cfg = json.loads((folder / "config.json").read_text())
        return _parse_config(cfg)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{folder}: not a readable EAGLE-3 head config ({e!r})") from e


def _parse_config(cfg: dict) -> HeadConfig:
    speculators = cfg.get("speculators_model_type") == "eagle3" \
        or "transformer_layer_config" in cfg
    layer = cfg["transformer_layer_config"] if speculators else cfg
    kind = layer.get("model_type", "llama")
    if kind not in LAYER_TYPES:
        raise ModelLoadError(f"EAGLE-3 heads of {', '.join(LAYER_TYPES)} layers run here, "
                             f"not '{kind}'")
    if layer.get("hidden_act", "silu") != "silu" or layer.get("mlp_bias"):
        raise ModelLoadError("EAGLE-3 heads with a SiLU MLP without biases run here")
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    rope = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None)
    draft = DraftConfig(
        hidden_size=hidden, num_layers=layer.get("num_hidden_layers", 1),
        intermediate_size=layer["intermediate_size"], num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or hidden // heads, vocab_size=layer["vocab_size"],
        embed_size=hidden, rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    head = HeadConfig(
        draft=draft,
        draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden=cfg.get("target_hidden_size") or hidden,
        aux_ids=list(nested) if nested else (list(top) if top else None),
        aux_are_outputs=bool(nested), rope_scaling=scaling,
        max_positions=layer.get("max_position_embeddings", 2048), qk_norm=kind == "qwen3",
        attention_bias=bool(layer.get("attention_bias")))
    if speculators:
        head.norm_before_residual = bool(cfg.get("norm_before_residual"))
        head.norm_before_fc = bool(cfg.get("norm_before_fc"))
        head.fc_norm = bool(cfg.get("fc_norm"))
        head.feed_normed = bool(cfg.get("norm_output"))
    else:
        head.fc_norm = bool(cfg.get("fc_norm"))
        head.norm_before_head = bool(cfg.get("norm_output", True))
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ModelLoadError("this EAGLE head reads the target's last hidden state only "
                             "(use_aux_hidden_state false): EAGLE-3 heads run here")
    return head


def feature_taps(head: HeadConfig, num_layers: int) -> list[int]:
    """The fused target states, as split.py's taps, in the order `fc` reads them."""
    if head.aux_ids is None:
        return [2, num_layers // 2, num_layers - 3]
    return [i + 1 if head.aux_are_outputs else i for i in head.aux_ids]


class FirstLayer(Block):
    """EAGLE-3's first layer: attention reads the normed embedding beside the normed feature;
    the residual stream starts from the feature."""

    def __init__(self, c: DraftConfig, norm_before_residual: bool):
        super().__init__(c)
        wide = 2 * c.hidden_size
        attn = self.self_attn
        attn.q_proj = nn.Linear(wide, c.num_heads * c.head_dim, bias=False)
        attn.k_proj = nn.Linear(wide, c.num_kv_heads * c.head_dim, bias=False)
        attn.v_proj = nn.Linear(wide, c.num_kv_heads * c.head_dim, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def __call__(self, embeds, feature, positions, mask, cache):
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + self.self_attn(x, positions, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Net(DraftNet):
    """An EAGLE-3 head in DraftNet's interface (`fused`, `top`, `norm`, `logits`): the MLX
    drafter feeds it as it feeds the project's feature drafts."""

    def __init__(self, config: DraftConfig, head: HeadConfig):
        super().__init__(replace(config, feature_layers=[]))
        self.config = config
        c, count = config, len(config.feature_layers)
        self.layers[0] = FirstLayer(c, head.norm_before_residual)
        for layer in self.layers:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj") if head.attention_bias else ():
                out, inp = attn[name].weight.shape
                attn[name] = nn.Linear(inp, out, bias=True)
            if head.qk_norm:
                attn.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
                attn.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
            attn.rope = initialize_rope(c.head_dim, c.rope_theta, False, head.rope_scaling,
                                        head.max_positions)
        if head.norm_before_fc:
            self.input_norm = nn.RMSNorm(count * c.feature_size, eps=c.rms_norm_eps)
        if head.fc_norm:
            self.fc_norm = [nn.RMSNorm(c.feature_size, eps=c.rms_norm_eps)
                            for _ in range(count)]
        self.fc = nn.Linear(count * c.feature_size, c.hidden_size, bias=False)
        # The drafter norms the head's output before `logits` (`self.norm`) and feeds the
        # head its own output unnormed (`top`): where a head's own features are post-norm,
        # `top` applies the final norm and `norm` is the identity; where its LM head reads
        # the output unnormed, there is no final norm at all.
        if head.feed_normed:
            self.out_norm = self.norm
        if head.feed_normed or not head.norm_before_head:
            self.norm = nn.Identity()
        self._unlike = ("EAGLE-3's first layer (attention over the embedding and the feature, "
                        "2 x hidden wide)",)

    def fused(self, target_features: list[mx.array]) -> mx.array:
        x = mx.concatenate(target_features, axis=-1)
        if "input_norm" in self:
            x = self.input_norm(x)
        if "fc_norm" in self:
            x = mx.concatenate([n(f) for n, f in zip(self.fc_norm, mx.split(
                x, len(self.fc_norm), axis=-1))], axis=-1)
        return self.fc(x)

    def _through(self, tokens: mx.array, positions, mask, cache, layers: int,
                 features: mx.array | None = None) -> mx.array:
        if features is None:
            raise ValueError("an EAGLE-3 head reads a feature for every token")
        mask = _without_first(mask, tokens.shape[1], positions,
                              cache[0].offset if cache is not None else 0)
        embeds = self.embed_tokens(tokens).astype(features.dtype)
        h = self.layers[0](embeds, features, positions, mask,
                           cache[0] if cache is not None else None)
        for i in range(1, layers):
            h = self.layers[i](h, positions, mask, cache[i] if cache is not None else None)
        return self.out_norm(h) if "out_norm" in self else h


def _without_first(mask, queries: int, positions, cached: int) -> mx.array:
    """`mask` (None, "causal" or boolean) as a boolean array that hides key 0 from every query
    but the one at position 0, where key 0 is position 0's: always once the cache holds
    anything (the rollout keeps position 0 in slot 0), else when this call starts there."""
    keys = cached + queries
    if mask is None or isinstance(mask, str):
        mask = (mx.arange(keys)[None] <= (cached + mx.arange(queries))[:, None])[None, None]
    if isinstance(positions, int):
        positions = mx.arange(positions, positions + queries)[None]
    first = mx.zeros_like(positions[:, :1]) if cached else positions[:, :1]
    hide = (positions > 0) & (first == 0)
    return mask & ~(hide[:, None, :, None] & (mx.arange(keys) == 0))


# -- reading a head folder --


def read_weights(folder: Path) -> dict[str, mx.array]:
    """All tensors of the folder's safetensors files (one, or shards), or of
    pytorch_model.bin (through torch, the export extra)."""
    files = sorted(folder.glob("*.safetensors"))
    try:
        if files:
            weights = {}
            for f in files:
                weights.update(mx.load(str(f)))
            return weights
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelLoadError(f"{folder}: no *.safetensors or pytorch_model.bin")
        try:
            import torch
        except ImportError as e:
            raise MissingExtra(f"{folder}: reading pytorch_model.bin needs torch (pip "
                               "install 'mirror-mlx[export]'), or save the head as "
                               "safetensors") from e
        weights = {}
        for f in bins:
            for k, t in torch.load(str(f), map_location="cpu", weights_only=True).items():
                t = t.float() if t.is_floating_point() else t
                weights[k] = mx.array(t.numpy())
        return weights
    except (OSError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{folder}: unreadable head weights ({e})") from e


def _our_names(weights: dict[str, mx.array], head: HeadConfig) -> dict[str, mx.array]:
    """The file's tensors under Eagle3Net's names (unknown names are kept, to be refused)."""
    renamed = {"lm_head.weight": "head.weight"}
    if head.feed_normed:
        renamed["norm.weight"] = "out_norm.weight"
    unread = ("d2t", "t2d") if head.norm_before_head else ("d2t", "t2d", "norm.weight")
    out = {}
    for k, v in weights.items():
        if k.startswith(IGNORED) or k in unread:
            continue
        k = "layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k
        out[renamed.get(k, k)] = v
    return out


def _head_tokens(weights: dict, head: HeadConfig, vocab: int, where: Path) -> list[int]:
    """Token ids of the head's outputs, from d2t (head index i is token i + d2t[i])."""
    n = head.draft_vocab_size
    if "d2t" not in weights:
        if n != vocab:
            raise ModelLoadError(f"{where}: the head scores {n} tokens of {vocab} but has no "
                                 "d2t map")
        return []
    d2t = np.array(weights["d2t"]).astype(np.int64)
    ids = np.arange(len(d2t)) + d2t
    if len(d2t) != n or ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != n:
        raise ModelLoadError(f"{where}: d2t does not map {n} head tokens to distinct tokens "
                             f"of the {vocab}-token vocabulary")
    if "t2d" in weights:
        t2d = np.array(weights["t2d"]).astype(bool)
        if t2d.shape != (vocab,) or t2d.sum() != n or not t2d[ids].all():
            raise ModelLoadError(f"{where}: its t2d and d2t maps disagree")
    return ids.tolist()


def _in_tap_order(weights: dict, head: HeadConfig, taps: list[int], size: int) -> list[int]:
    """Ascending taps (split.py keeps the target's states in layer order), with `fc`'s input
    blocks and the norms before it permuted to match."""
    order = sorted(range(len(taps)), key=lambda i: taps[i])
    if order == list(range(len(taps))):
        return taps

    def blocks(w: mx.array) -> mx.array:
        return mx.concatenate([w[..., i * size : (i + 1) * size] for i in order], axis=-1)

    weights["fc.weight"] = blocks(weights["fc.weight"])
    if "input_norm.weight" in weights:
        weights["input_norm.weight"] = blocks(weights["input_norm.weight"])
    norms = [weights.get(f"fc_norm.{i}.weight") for i in range(len(taps))]
    if head.fc_norm and all(n is not None for n in norms):
        for j, i in enumerate(order):
            weights[f"fc_norm.{j}.weight"] = norms[i]
    return [taps[i] for i in order]


def load_eagle3(folder: Path, target: LoadedModel, target_info: dict | None = None
                ) -> Eagle3Net:
    """The head in `folder` as a draft for `target`; IncompatibleDraft where it was made for
    another target (hidden size, vocabulary, layers), saying what differs."""
    check_splittable(target.model)
    head = read_config(folder)
    raw = {k.removeprefix("model."): v for k, v in read_weights(folder).items()}
    args = target.model.args
    vocab, width, depth = target.vocab_size, args.hidden_size, target.num_layers
    c = head.draft
    if c.vocab_size != vocab:
        raise IncompatibleDraft(f"{folder}: the head is for a {c.vocab_size}-token "
                                f"vocabulary, {target.path.name}'s has {vocab}")
    if head.target_hidden != width:
        raise IncompatibleDraft(f"{folder}: the head reads hidden states {head.target_hidden} "
                                f"wide, {target.path.name}'s are {width}")
    weights = _our_names(raw, head)
    fc = weights.get("fc.weight")
    if fc is None or fc.ndim != 2 or fc.shape[0] != c.hidden_size or fc.shape[1] % width:
        raise ModelLoadError(f"{folder}: no fc weight mapping k x {width} target features to "
                             f"the head's {c.hidden_size} (fc: "
                             f"{None if fc is None else tuple(fc.shape)})")
    taps = feature_taps(head, depth)
    count = fc.shape[1] // width
    if len(taps) != count:
        raise ModelLoadError(f"{folder}: fc reads {count} target layers, the config names "
                             f"{len(taps)} ({taps})")
    if len(set(taps)) != len(taps) or not all(0 < t <= depth for t in taps):
        raise IncompatibleDraft(
            f"{folder}: the head fuses the target's hidden states after layers {taps}; "
            f"{target.path.name} has {depth} layers (each in 1..{depth}, once)")
    taps = _in_tap_order(weights, head, taps, width)
    shared = "embed_tokens.weight" not in weights
    if shared and c.hidden_size != width:
        raise IncompatibleDraft(f"{folder}: the head is {c.hidden_size} wide and has no "
                                f"embedding of its own; {target.path.name}'s is {width} wide")
    config = replace(c, head_tokens=_head_tokens(raw, head, vocab, folder),
                     feature_layers=taps, feature_size=width, shared_embedding=shared,
                     target=target_info or {})
    net = Eagle3Net(config, head)
    if isinstance(net.layers[0].self_attn.rope, DynamicNTKScalingRoPE):
        raise ModelLoadError(f"{folder}: dynamic (NTK) rope scaling is not supported: it "
                             "rescales by the sequence length, which a tree of drafts lacks")
    expected = dict(tree_flatten(net.parameters()))
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(k for k in set(expected) - set(weights)
                     if not (shared and k.startswith("embed_tokens.")))
    if unknown or missing:
        raise ModelLoadError(f"{folder}: weights do not match its config (unexpected: "
                             f"{unknown[:3]}, missing: {missing[:3]})")
    wrong = [f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})"
             for k, v in weights.items() if v.shape != expected[k].shape]
    if wrong:
        raise ModelLoadError(f"{folder}: weights do not match its config: {wrong[:3]}")
    if resolve_dtype("auto") == "float32":  # the CPU policy; elsewhere weights stay as stored
        weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    net.load_weights(list(weights.items()), strict=False)
    if shared:
        net.embed_tokens = target.model.model.embed_tokens
    mx.eval(net.parameters(), [v for layer in net.layers
                               for v in layer.self_attn.rope.values() if isinstance(v, mx.array)])
    return net
