"""The draft network: a small llama-style decoder that takes explicit positions and an explicit
attention mask, so one call can advance many branches laid out as a token tree.

It reads the target's token embedding (shared, not stored), may be narrower than the target
(an input projection bridges the widths), and may score only a subset of the vocabulary (the
LM head dominates a small draft's cost: PLATFORM.md). A plain llama model (the target's first
layers, or an mlx-lm / GGUF llama) converts into this form with `DraftNet.from_llama`.

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

from ..errors import ModelLoadError
from ..models.load import dequantize

FORMAT = "mirror-mlx-draft"
# mlx-lm model types whose layers are the draft's own (a llama block): `from_llama` shares them.
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")


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
            head_dim=args.head_dim or args.hidden_size // args.num_attention_heads,
            vocab_size=args.vocab_size, embed_size=args.hidden_size,
            rms_norm_eps=args.rms_norm_eps, rope_theta=args.rope_theta, **extra)


def rope(x: mx.array, positions: mx.array | int, base: float) -> mx.array:
    """Rotary embedding at explicit positions: `positions` is an int (contiguous from there) or
    an int32 array of shape (B, T) with one position per token."""
    if isinstance(positions, int):
        return mx.fast.rope(x, x.shape[-1], traditional=False, base=base, scale=1.0,
                            offset=positions)
    B, H, T, D = x.shape
    # mx.fast.rope takes one offset per batch row: give every token a row of its own.
    rows = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)
    rows = mx.fast.rope(rows, D, traditional=False, base=base, scale=1.0,
                        offset=positions.reshape(-1))
    return rows.reshape(B, T, H, D).transpose(0, 2, 1, 3)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.base = c.rope_theta
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def __call__(self, x, positions, mask, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv, -1).transpose(0, 2, 1, 3)
        q, k = rope(q, positions, self.base), rope(k, positions, self.base)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
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
        h = x + self.self_attn(self.input_layernorm(x), positions, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


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

    @property
    def head_ids(self) -> mx.array:
        return self._head_ids

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
        if self.config.tie_head:
            return self.embed_tokens.as_linear(h)
        return self.head(h)

    def __call__(self, tokens, positions=0, mask="causal", cache=None, features=None) -> mx.array:
        return self.logits(self.hidden(tokens, positions, mask, cache, features))

    # -- conversion, saving and loading --

    @staticmethod
    def from_llama(model: nn.Module, num_layers: int | None = None,
                   target_info: dict | None = None) -> DraftNet:
        """A draft made of a llama model's first `num_layers` layers, its final norm and its
        output layer, sharing (not copying) the weights."""
        if getattr(model, "model_type", None) not in LLAMA_STYLE:
            raise ModelLoadError(
                f"a draft cannot be made of the layers of a '{getattr(model, 'model_type', '?')}'"
                f" model (only {', '.join(LLAMA_STYLE)}); train one with mirror-mlx distill"
            )
        args = model.args
        n = num_layers or len(model.layers)
        tied = not hasattr(model, "lm_head")
        config = DraftConfig.like(args, n, tie_head=tied, target=target_info or {})
        if getattr(args, "rope_scaling", None) or getattr(args, "rope_traditional", False):
            raise ModelLoadError("drafts with rope scaling or traditional rope are not supported")
        net = DraftNet(config)
        net.embed_tokens = model.model.embed_tokens
        net.norm = model.model.norm
        if not tied:
            net.head = model.lm_head
        for mine, theirs in zip(net.layers, model.model.layers[:n]):
            # Share the modules themselves, so quantized targets stay quantized.
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(mine.self_attn, name, getattr(theirs.self_attn, name))
            mine.mlp = theirs.mlp
            mine.input_layernorm = theirs.input_layernorm
            mine.post_attention_layernorm = theirs.post_attention_layernorm
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
        except (OSError, ValueError):
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
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
            raise ModelLoadError(f"{folder}: not a readable draft ({e})") from e
        net = DraftNet(config)
        if quant:
            nn.quantize(net, group_size=quant["group_size"], bits=quant["bits"],
                        class_predicate=_quantizable)
        if config.shared_embedding and embedding is None:
            raise ModelLoadError(f"{folder}: this draft reads the target's embedding")
        try:
            net.load_weights(list(weights.items()), strict=False)
        except ValueError as e:
            raise ModelLoadError(f"{folder}: weights do not match the config ({e})") from e
        missing = {k for k, _ in tree_flatten(net.parameters())} - set(weights)
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


def _quantizable(path: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.shape[-1] % QUANT_GROUP == 0


def _quantized_copy(net: DraftNet, bits: int) -> DraftNet:
    copy = DraftNet(net.config)
    copy.update(net.parameters())
    nn.quantize(copy, group_size=QUANT_GROUP, bits=bits, class_predicate=_quantizable)
    return copy
