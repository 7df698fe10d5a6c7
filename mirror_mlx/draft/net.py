"""The draft network: a small llama-style decoder that takes explicit positions and an explicit
attention mask, so one call can advance many branches laid out as a token tree.

It reads the target's token embedding (shared, not stored), may be narrower than the target
(an input projection bridges the widths), and may score only a subset of the vocabulary (the
LM head dominates a small draft's cost: PLATFORM.md). A model of the families models/split.py
knows (the target's first layers, or an mlx-lm / GGUF model) converts into this form with
`DraftNet.from_model`, sharing its modules: its own rope (scaled or partial), qk-norm, fused
qkv projection, gemma's sandwich norms, embedding scale, logit soft-capping and sliding
windows come along.

A feature-conditioned draft (EAGLE-3's idea; `feature_layers` set) also reads the target's own
hidden states: token t enters as its embedding mixed with a feature vector, the target's
outputs of `feature_layers` after token t - 1 fused into one (what the target "knew" just before
writing t). Where the target has not run yet (the draft's own tokens), the feature is the
draft's own last hidden state at t - 1; training unrolls the draft on its own features so that
this holds up (train/feature.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

from ..errors import ModelLoadError
from ..models import split
from ..models.load import check_weights, dequantize, quantized_paths

FORMAT = "mirror-mlx-draft"


@dataclass
class DraftConfig:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the input vocabulary: the target's
    embed_size: int  # width of the (shared) input embedding
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Output vocabulary: token ids the head scores, in head order; empty = all of them.
    head_tokens: list[int] = field(default_factory=list)
    tie_head: bool = False  # head = the shared embedding (needs full vocab, same width)
    # Speculative streaming (MIRROR_SD.md section 4): the top layer also runs this many stream
    # positions after a token, predicting the tokens 2, 3, ... ahead in the same forward.
    stream_count: int = 0
    # Target layers whose outputs a feature-conditioned draft reads (empty: tokens only), and
    # the target's hidden size.
    feature_layers: list[int] = field(default_factory=list)
    feature_size: int = 0
    shared_embedding: bool = True  # the input embedding is the target's, set at load time
    target: dict = field(default_factory=dict)  # what it was made for (name, vocab fingerprint)

    @property
    def head_size(self) -> int:
        return len(self.head_tokens) or self.vocab_size

    @staticmethod
    def like(args, num_layers: int, **extra) -> DraftConfig:
        """A draft as wide as the llama model whose mlx-lm `args` are given."""
        return DraftConfig(
            hidden_size=args.hidden_size, num_layers=num_layers,
            intermediate_size=args.intermediate_size, num_heads=args.num_attention_heads,
            num_kv_heads=args.num_key_value_heads,
            head_dim=getattr(args, "head_dim", None)
            or args.hidden_size // args.num_attention_heads,
            vocab_size=args.vocab_size, embed_size=args.hidden_size,
            rms_norm_eps=args.rms_norm_eps, rope_theta=args.rope_theta, **extra)


def rope(x: mx.array, positions: mx.array | int, rotate: nn.Module) -> mx.array:
    """Rotary embedding at explicit positions: `rotate` is a rope module of mlx-lm's (nn.RoPE
    or a scaled one from rope_utils), called with an offset; `positions` is an int (contiguous
    from there) or an int32 array of shape (B, T) with one position per token."""
    if isinstance(positions, int):
        return rotate(x, offset=positions)
    B, H, T, D = x.shape
    # mx.fast.rope takes one offset per batch row: give every token a row of its own.
    rows = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)
    rows = rotate(rows, offset=positions.reshape(-1))
    return rows.reshape(B, T, H, D).transpose(0, 2, 1, 3)


def capped_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask,
                     cap: float) -> mx.array:
    """Attention with soft-capped scores (gemma 2), which the fused kernel does not do."""
    repeats = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeats, axis=1), mx.repeat(v, repeats, axis=1)
    scores = mx.tanh((q * scale) @ k.swapaxes(-1, -2) / cap) * cap
    if isinstance(mask, str):
        mask = create_causal_mask(q.shape[2], k.shape[2] - q.shape[2])
    if mask is not None:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return mx.softmax(scores, axis=-1, precise=True) @ v


def windowed(mask, queries: int, keys: int, window: int) -> mx.array:
    """`mask` narrowed to a sliding window: each query sees its last `window` visible keys. Those
    are the positions of its window, as the draft's cache holds each position from 0 up once
    along every query's path (the prefix, then its branch), in order."""
    if mask is None or isinstance(mask, str):
        return create_causal_mask(queries, keys - queries, window_size=window)
    return mask & (mx.cumsum(mask.astype(mx.int32), axis=-1, reverse=True) <= window)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rope = nn.RoPE(c.head_dim, traditional=False, base=c.rope_theta)
        self.scale = c.head_dim**-0.5
        self.softcap = 0.0  # attention logit soft-capping (gemma 2), 0: none
        self.window = 0  # sliding window (some layers of gemma 3, some llamas), 0: none
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def __call__(self, x, positions, mask, cache):
        B, T, _ = x.shape
        if "qkv_proj" in self:  # fused (phi3)
            n_q, n_kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = mx.split(self.qkv_proj(x), [n_q, n_q + n_kv], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.reshape(B, T, self.n_heads, -1), k.reshape(B, T, self.n_kv, -1)
        if "q_norm" in self:  # qk-norm (qwen3, gemma 3): each head's query and key
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(0, 2, 1, 3), positions, self.rope)
        k = rope(k.transpose(0, 2, 1, 3), positions, self.rope)
        v = v.reshape(B, T, self.n_kv, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.window:
            mask = windowed(mask, T, k.shape[2], self.window)
        if self.softcap:
            out = capped_attention(q, k, v, self.scale, mask, self.softcap)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(self, x, positions, mask, cache):
        r = self.self_attn(self.input_layernorm(x), positions, mask, cache)
        if "pre_feedforward_layernorm" not in self:
            h = x + r
            return h + self.mlp(self.post_attention_layernorm(h))
        # Gemma's sandwich: each sublayer's output is normed again before the residual add.
        h = x + self.post_attention_layernorm(r)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def adopt(self, theirs: nn.Module) -> None:
        """Share the modules of `theirs`, a decoder layer of mlx-lm's (see `from_model`), so
        that quantized targets stay quantized; its attention scale and soft-capping too."""
        mine, src = self.self_attn, theirs.self_attn
        if "qkv_proj" in src:
            for name in ("q_proj", "k_proj", "v_proj"):
                mine.pop(name)
        for name in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm",
                     "rope"):
            if name in src:
                setattr(mine, name, src[name])
        mine.scale = src.scale
        mine.softcap = getattr(src, "attn_logit_softcapping", None) or 0.0
        self.mlp = theirs.mlp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            if name in theirs:
                setattr(self, name, theirs[name])


class DraftNet(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_size)
        if config.embed_size != config.hidden_size:
            self.in_proj = nn.Linear(config.embed_size, config.hidden_size, bias=False)
        if config.feature_layers:
            # The target's layers differ in scale by orders of magnitude: each is normed
            # before the fusion; the draft's own features are normed likewise before mixing.
            self.feature_norms = [nn.RMSNorm(config.feature_size, eps=config.rms_norm_eps)
                                  for _ in config.feature_layers]
            self.fuse = nn.Linear(len(config.feature_layers) * config.feature_size,
                                  config.hidden_size, bias=False)
            self.feature_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mix = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = [Block(config) for _ in range(config.num_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if not config.tie_head:
            self.head = nn.Linear(config.hidden_size, config.head_size, bias=False)
        if config.stream_count:
            self.stream_embed = 0.02 * mx.random.normal((config.stream_count, config.hidden_size))
        # Head index -> token id (identity when the head scores the whole vocabulary); the
        # leading underscore keeps it out of the parameters.
        self._head_ids = mx.array(config.head_tokens or list(range(config.vocab_size)), mx.int32)
        # Set by `from_model` for families that have them (gemma): the embedding's scale, the
        # final logits' soft cap, and what the draft has beyond what `config` describes.
        self._embed_scale: mx.array | None = None
        self._logit_cap = 0.0
        self._unlike: tuple[str, ...] = ()

    @property
    def unlike_llama(self) -> tuple[str, ...]:
        """What this draft computes beyond the plain llama form its `config` describes (what
        `save` writes, distill trains and a Core ML package computes); empty if nothing."""
        return self._unlike

    @property
    def head_ids(self) -> mx.array:
        return self._head_ids

    def set_head(self, tokens: list[int], weight: mx.array) -> None:
        """Score `tokens` instead, with these rows (an untied, restricted head)."""
        self.config.head_tokens = list(tokens)
        self.head = nn.Linear(self.config.hidden_size, len(tokens), bias=False)
        self.head.weight = weight
        self._head_ids = mx.array(tokens, mx.int32)

    @property
    def reads_features(self) -> bool:
        return bool(self.config.feature_layers)

    def fused(self, target_features: list[mx.array]) -> mx.array:
        """The feature vectors (..., hidden) of the target's outputs at `feature_layers`."""
        return self.fuse(mx.concatenate(
            [n(f) for n, f in zip(self.feature_norms, target_features)], axis=-1))

    def hidden(self, tokens: mx.array, positions: mx.array | int, mask, cache=None,
               features: mx.array | None = None) -> mx.array:
        """Final-normed hidden states (B, T, hidden). `mask`: None, "causal", or a boolean
        (B or 1, 1, T, cached + T) array, True where a token may attend. `features` (B, T,
        hidden): a feature-conditioned draft's feature for each token (see `fused`)."""
        return self.norm(self.top(tokens, positions, mask, cache, features))

    def top(self, tokens: mx.array, positions: mx.array | int, mask, cache=None,
            features: mx.array | None = None) -> mx.array:
        """The last layer's output before the final norm: what a feature-conditioned draft
        feeds itself as the next token's feature."""
        return self._through(tokens, positions, mask, cache, len(self.layers), features)

    def _through(self, tokens: mx.array, positions, mask, cache, layers: int,
                 features: mx.array | None = None) -> mx.array:
        """Embed `tokens` and run the first `layers` layers (no final norm)."""
        h = self.embed_tokens(tokens)
        if self._embed_scale is not None:
            h = h * self._embed_scale.astype(h.dtype)
        if "in_proj" in self:
            h = self.in_proj(h)
        if self.reads_features:
            h = self.mix(mx.concatenate([self.feature_norm(features), h.astype(features.dtype)],
                                        axis=-1))
        for i, layer in enumerate(self.layers[:layers]):
            h = layer(h, positions, mask, cache[i] if cache is not None else None)
        return h

    def hidden_with_streams(self, tokens: mx.array, positions: mx.array | int, mask,
                            cache=None, rows: list[int] | None = None
                            ) -> tuple[mx.array, mx.array]:
        """Like `hidden`, plus the streams after each token of `rows` (default: all): (main
        (B, T, hidden), streams (B, len(rows), stream_count, hidden)). Stream j after a token
        at position p starts from that token's input to the top layer plus a learned stream
        embedding, sits at position p + j, sees what the token sees and the streams before it,
        and predicts the token at p + 1 + j. Streams leave nothing in the cache."""
        S = self.config.stream_count
        B, T = tokens.shape
        rows = list(range(T)) if rows is None else rows
        R = len(rows)
        h = self._through(tokens, positions, mask, cache, len(self.layers) - 1)
        top = self.layers[-1]
        idx = mx.array(rows)
        streams = (h[:, idx, None, :] + self.stream_embed[None, None]).reshape(B, R * S, -1)
        if isinstance(positions, int):
            positions = mx.broadcast_to(mx.arange(positions, positions + T)[None], (B, T))
        offsets = mx.arange(1, S + 1)[None, None]
        stream_pos = (positions[:, idx, None] + offsets).reshape(B, R * S)
        top_cache = cache[-1] if cache is not None else None
        cached = top_cache.offset if top_cache is not None else 0
        if mask is None or isinstance(mask, str):  # causal over the cache and the new tokens
            mask = mx.arange(cached + T)[None] <= (cached + mx.arange(T))[:, None]
            mask = mask[None, None]
        seen = mx.repeat(mask[..., idx, :], S, axis=2)  # each stream sees what its token sees
        among = mx.kron(mx.eye(R), mx.tril(mx.ones((S, S)))).astype(mx.bool_)
        full = mx.concatenate([
            mx.concatenate([mask, mx.zeros((*mask.shape[:2], T, R * S), mx.bool_)], axis=-1),
            mx.concatenate([seen, mx.broadcast_to(among, (*seen.shape[:2], R * S, R * S))],
                           axis=-1),
        ], axis=2)
        out = top(mx.concatenate([h, streams], axis=1),
                  mx.concatenate([positions, stream_pos], axis=1), full, top_cache)
        if top_cache is not None:
            top_cache.offset -= R * S  # the streams' keys were appended last: drop them
        out = self.norm(out)
        return out[:, :T], out[:, T:].reshape(B, R, S, -1)

    def logits(self, h: mx.array) -> mx.array:
        """Scores over the head's vocabulary (see `head_ids`)."""
        logits = self.embed_tokens.as_linear(h) if self.config.tie_head else self.head(h)
        return mx.tanh(logits / self._logit_cap) * self._logit_cap if self._logit_cap else logits

    def __call__(self, tokens, positions=0, mask="causal", cache=None, features=None) -> mx.array:
        return self.logits(self.hidden(tokens, positions, mask, cache, features))

    # -- conversion, saving and loading --

    @staticmethod
    def from_model(model: nn.Module, num_layers: int | None = None,
                   target_info: dict | None = None) -> DraftNet:
        """A draft made of an mlx-lm model's first `num_layers` layers, its final norm and its
        output layer, sharing (not copying) the weights; the model must be of a family that
        models/split.py knows (ModelLoadError otherwise, or for a rope it can't run)."""
        if not split.splittable(model):
            raise ModelLoadError(
                f"a draft of model type '{getattr(model, 'model_type', '?')}' is not supported: "
                f"drafts run the layers of the families {', '.join(split.SPLIT_MODEL_TYPES)}")
        rotate = model.model.layers[0].self_attn.rope
        if isinstance(rotate, DynamicNTKScalingRoPE):
            raise ModelLoadError("a draft with dynamic (NTK) rope scaling is not supported: it "
                                 "rescales by the sequence length, which a tree of drafts lacks")
        n = num_layers or len(model.layers)
        tied = not hasattr(model, "lm_head")
        config = DraftConfig.like(model.args, n, tie_head=tied, target=target_info or {})
        net = DraftNet(config)
        net.embed_tokens = model.model.embed_tokens
        net.norm = model.model.norm
        if not tied:
            net.head = model.lm_head
        for mine, theirs, window in zip(net.layers, model.model.layers[:n],
                                        split.layer_windows(model)):
            mine.adopt(theirs)
            mine.self_attn.window = window or 0
        net._embed_scale = split.embed_scale(model)
        net._logit_cap = getattr(model, "final_logit_softcapping", None) or 0.0
        net._unlike = unlike_llama(model, config)
        # A scaled rope's frequency table is no parameter, and stays lazy until evaluated: here,
        # since the draft may run in another thread, where this thread's stream does not exist.
        mx.eval([v for layer in net.layers for v in layer.self_attn.rope.values()
                 if isinstance(v, mx.array)], net._embed_scale)
        return net

    def save(self, folder: str | Path, bits: int | None = None) -> None:
        """Write config.json and weights.safetensors; `bits` (8 or 4) stores the linear
        layers quantized (groups of 64), which `load` widens again per the dtype policy."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        skip = ("embed_tokens.",) if self.config.shared_embedding else ()
        params = self.parameters()
        if bits:
            params = {k: v for k, v in _quantized_copy(self, bits).parameters().items()}
        weights = {k: v for k, v in tree_flatten(params) if not k.startswith(skip)}
        mx.save_safetensors(str(folder / "weights.safetensors"), weights)
        meta = {"format": FORMAT, **asdict(self.config)}
        if bits:
            meta["quantization"] = {"bits": bits, "group_size": QUANT_GROUP}
        (folder / "config.json").write_text(json.dumps(meta, indent=1))

    @staticmethod
    def is_draft_folder(folder: Path) -> bool:
        try:
            return json.loads((folder / "config.json").read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):  # AttributeError: not a JSON object
            return False

    @staticmethod
    def load(folder: str | Path, embedding: nn.Module | None = None,
             dtype: str = "float32") -> DraftNet:
        """Load a saved draft; `embedding` is the target's token embedding when shared.
        Quantized weights are widened to `dtype` unless it is "quantized"."""
        folder = Path(folder)
        try:
            raw = json.loads((folder / "config.json").read_text())
            raw.pop("format")
            quant = raw.pop("quantization", None)
            config = DraftConfig(**raw)
            weights = mx.load(str(folder / "weights.safetensors"))
        except (OSError, ValueError, TypeError, KeyError, RuntimeError, AttributeError) as e:
            raise ModelLoadError(f"{folder}: not a readable draft ({e})") from e
        _check_config(config, quant, weights, embedding, folder)
        net = DraftNet(config)
        if quant:
            nn.quantize(net, group_size=quant["group_size"], bits=quant["bits"],
                        class_predicate=_quantizable)
        if config.shared_embedding and embedding is None:
            raise ModelLoadError(f"{folder}: this draft reads the target's embedding")
        # load_weights(strict=False) checks neither shapes nor dtypes: a config that lies
        # about a width would only fail (or compute garbage) at the first forward.
        expected = dict(tree_flatten(net.parameters()))
        unexpected = sorted(set(weights) - set(expected))
        if unexpected:
            raise ModelLoadError(f"{folder}: weights the config has no place for "
                                 f"{unexpected[:3]}")
        for k, w in weights.items():
            if w.shape != expected[k].shape:
                raise ModelLoadError(f"{folder}: weights do not match the config ('{k}' is "
                                     f"{tuple(w.shape)}, the config makes it "
                                     f"{tuple(expected[k].shape)})")
        check_weights(weights.items(), str(folder), quantized_paths(net))
        try:
            net.load_weights(list(weights.items()), strict=False)
        except ValueError as e:
            raise ModelLoadError(f"{folder}: weights do not match the config ({e})") from e
        missing = set(expected) - set(weights)
        if config.shared_embedding:
            missing = {k for k in missing if not k.startswith("embed_tokens.")}
        if missing:
            raise ModelLoadError(f"{folder}: missing weights {sorted(missing)[:3]}")
        if quant and dtype != "quantized":
            dequantize(net, getattr(mx, dtype))
        if config.shared_embedding:  # after dequantizing: the target's embedding stays as it is
            net.embed_tokens = embedding
        mx.eval(net.parameters())
        return net


QUANT_GROUP = 64


def _check_config(c: DraftConfig, quant, weights: dict, embedding, folder: Path) -> None:
    """What a saved config must satisfy before a net is built from it (a lie about a size
    would build a net that fails, hangs or computes garbage at its first forward)."""
    def bad(what: str) -> ModelLoadError:
        return ModelLoadError(f"{folder}: damaged draft config ({what})")

    sizes = ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
             "head_dim", "vocab_size", "embed_size")
    for name in sizes:
        v = getattr(c, name)
        if type(v) is not int or v < 1:
            raise bad(f"{name} {v!r} is not a positive integer")
    if c.num_heads % c.num_kv_heads:
        raise bad(f"{c.num_heads} heads do not share {c.num_kv_heads} KV heads evenly")
    for name in ("stream_count", "feature_size"):
        v = getattr(c, name)
        if type(v) is not int or v < 0:
            raise bad(f"{name} {v!r} is not a count")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(c, name)
        if not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise bad(f"{name} {v!r} is not a positive number")
    if not isinstance(c.head_tokens, list) or not all(
            type(t) is int and 0 <= t < c.vocab_size for t in c.head_tokens):
        raise bad(f"head_tokens must be token ids below {c.vocab_size}")
    if not isinstance(c.feature_layers, list) or not all(
            type(n) is int and n > 0 for n in c.feature_layers) or (
            c.feature_layers and c.feature_size < 1):
        raise bad("feature_layers must be layer numbers from 1, with a feature_size")
    if not isinstance(c.target, dict):
        raise bad("target is not an object")
    layers = {k.split(".")[1] for k in weights if k.startswith("layers.")}
    if len(layers) != c.num_layers:
        raise bad(f"num_layers {c.num_layers}, the weights hold {len(layers)} layers")
    rows = getattr(embedding, "weight", None)
    if c.shared_embedding and rows is not None and rows.shape[0] != c.vocab_size:
        raise bad(f"vocab_size {c.vocab_size}, the target's embedding has {rows.shape[0]} rows")
    if quant is not None and not (isinstance(quant, dict) and quant.get("bits") in (2, 3, 4, 5,
                                  6, 8) and quant.get("group_size") in (32, 64, 128)):
        raise bad(f"quantization {quant!r}")


def _quantizable(path: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.shape[-1] % QUANT_GROUP == 0


def _quantized_copy(net: DraftNet, bits: int) -> DraftNet:
    copy = DraftNet(net.config)
    copy.update(net.parameters())
    nn.quantize(copy, group_size=QUANT_GROUP, bits=bits, class_predicate=_quantizable)
    return copy


def unlike_llama(model: nn.Module, config: DraftConfig) -> tuple[str, ...]:
    """What a draft converted from `model` computes beyond the plain llama form of `config`."""
    layer, kind = model.model.layers[0], model.model_type
    attn, rotate = layer.self_attn, layer.self_attn.rope
    plain_rope = all(
        type(r) is nn.RoPE and not r.traditional and r.scale == 1.0
        and r.dims == config.head_dim and r.base == config.rope_theta
        for r in (li.self_attn.rope for li in model.model.layers))
    found = {
        f"{type(rotate).__name__} rope (scaled, partial or per layer)": not plain_rope,
        "a fused qkv projection": "qkv_proj" in attn,
        "biases": any(k.endswith(".bias") for k, _ in tree_flatten(layer.parameters())),
        "qk-norm": "q_norm" in attn,
        "an attention scale other than 1/sqrt(head_dim)": attn.scale != config.head_dim**-0.5,
        "gemma's norms, MLP and embedding scale": kind.startswith("gemma"),
        "attention logit soft-capping": bool(getattr(attn, "attn_logit_softcapping", None)),
        "final logit soft-capping": bool(getattr(model, "final_logit_softcapping", None)),
        "a fused gate/up projection": "gate_up_proj" in layer.mlp,
        "sliding-window layers": any(split.layer_windows(model)),
    }
    return tuple(what for what, present in found.items() if present)


def llama_source(model: nn.Module, num_layers: int) -> DraftNet:
    """`from_model` for a starting point that must be of the plain llama form (distill)."""
    net = DraftNet.from_model(model, num_layers)
    if net.unlike_llama:
        raise ModelLoadError(
            f"distill trains drafts of the plain llama form; this target has "
            f"{', '.join(net.unlike_llama)} (its own layers can draft: --draft self:N)")
    return net
