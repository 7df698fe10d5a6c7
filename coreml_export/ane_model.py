"""The draft network (mirror_mlx/draft/net.py) in PyTorch, laid out for the Neural Engine, with
the input/output/state contract of mirror_mlx/draft/coreml_package.py.

Each ANE-specific choice is stated once, where it is made:
- Activations are channels-first (B, C, 1, S) and every linear layer is a 1x1 convolution: the
  layout the Neural Engine computes natively (Apple, "Deploying Transformers on the ANE").
- Attention is split per head, with explicit matmuls in forms Core ML lowers without
  transposes: scores in the einsum form it maps to its own einsum op, the weighted sum of
  values as one matmul with its first operand transposed (flag, not op). Both caches are stored
  (L, 1, D) per head, so each forward writes them along L, never along their innermost axis:
  a state written along the innermost axis at a run-time offset may leave the Neural Engine
  (coremltools #2553, Anemll #27). SDPA is not used (its fused form needs scale=None; the
  decomposed one inserts transposes).
- The softmax scale is folded into the query weights, and rotary embedding's rotate-half is
  folded into the q/k weights: one convolution yields each head and its rotated copy, so rope
  is two multiplies and an add, without slicing or negating activations.
- RMSNorm divides by the max-abs first: x * x summed over 576 channels overflows fp16 for
  activations of a few hundred (the Neural Engine has no fp32 path).
- A scaled rope (linear, llama3, yarn, longrope) is plain rope at other frequencies: the host's
  cos/sin tables carry it (one table per distinct rope, e.g. gemma 3's local and global ones),
  and yarn's mscale on q and k is folded into the attention scale.
- qk-norm (qwen3, gemma 3) is an RMS norm over each head's D channels, before rope: one
  convolution still yields each head and its rotated copy, and both are scaled by the head's
  one inverse RMS (rotate_half permutes a head's entries, so their RMS is the same) times the
  norm's weight, permuted for the copy; the softmax scale folds into that weight.
- Biases (qwen2) stay in the 1x1 convolutions, which the Neural Engine computes with a bias.
- Gemma: its norms' 1 + w is the stored weight (draft_weights), its MLP gates with tanh-GELU
  (a MIL op the Neural Engine runs), its embedding scale is one multiply on the host's
  embeddings (the host sends the target's raw rows, which a tied head reads unscaled). Its
  residual stream outgrows fp16 (Gemma 3 270M's passes 65,504 from its 8th layer): every read
  of the stream is through an RMS norm and every write is post-normed, so the package carries
  the stream, and each sublayer's output before its post-norm, at SANDWICH_SCALE.
- An EAGLE-3 head's first layer concatenates the normed embedding and the normed feature along
  the channels (the layout's concat axis), so its q/k/v are 1x1 convolutions 2 x hidden wide;
  the host hides key 0 in the mask, as it builds every mask.
- Gemma 2's soft caps, cap * tanh(x / cap), are a tanh (a Neural Engine op) and a multiply,
  with 1 / cap folded into the query weights (attention) or the head's (logits).
- A sliding-window layer reads the host's second mask (window_mask), the first one narrowed to
  the window: the host's tree mask already encodes what each token sees, and the window is a
  count along that (net.windowed), which the host computes exactly; the cache keeps every slot.
- The KV cache is Core ML state (two fp16 tensors), written at a runtime slot with slice
  updates; attention always reads the whole fixed-length cache under an additive mask, so every
  shape is static except the query length S, which takes a few enumerated values.

The module computes in float32 on the CPU (the reference executor runs it); the conversion
runs it in fp16. The states are fp16 in both.
"""

from __future__ import annotations

from mirror_mlx.draft.coreml_package import Form, PackageSpec, head_chunks
from mirror_mlx.draft.net import DraftConfig
from mirror_mlx.errors import ModelLoadError

import numpy as np
import torch
from torch import nn

NORM_FLOOR = 1e-2  # keeps the divisor positive and eps / m^2 in fp16 range
SANDWICH_SCALE = 2.0**-8  # gemma's residual stream in the package: room up to 1.6e7


def conv(weight: np.ndarray, bias: np.ndarray | None = None) -> nn.Conv2d:
    """A 1x1 convolution computing the linear layer `weight` (out, in)."""
    out_ch, in_ch = weight.shape
    layer = nn.Conv2d(in_ch, out_ch, 1, bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight).reshape(out_ch, in_ch, 1, 1))
        if bias is not None:
            layer.bias.copy_(torch.from_numpy(bias))
    return layer.requires_grad_(False)


def with_rotation(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Rows (or bias entries) per head laid out as [head, rotate_half(head)], where
    rotate_half(x) = (-x[D/2:], x[:D/2]) is the second term of non-traditional rope."""
    w = w.reshape(heads, head_dim, *w.shape[1:])
    half = head_dim // 2
    rot = np.concatenate([-w[:, half:], w[:, :half]], axis=1)
    return np.stack([w, rot], axis=1).reshape(heads * 2 * head_dim, *w.shape[2:])


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the channels, as (1 / m) / sqrt(mean(xs^2) + eps / m^2)
    for xs = x / m: x * x itself would overflow fp16 for activations of a few hundred."""
    m = x.abs().amax(dim=1, keepdim=True) + NORM_FLOOR
    xs = x / m
    return torch.rsqrt(xs.square().mean(dim=1, keepdim=True) + eps / (m * m)) / m


class RMSNorm(nn.Module):
    def __init__(self, weight: np.ndarray, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.from_numpy(weight).reshape(1, -1, 1, 1), False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / rms(x) == xs / sqrt(mean(xs^2) + eps / m^2) for xs = x / m, any m > 0.
        m = x.abs().amax(dim=1, keepdim=True) + NORM_FLOOR
        xs = x / m
        return xs * torch.rsqrt(xs.square().mean(dim=1, keepdim=True) + self.eps / (m * m)) \
            * self.weight


class Attention(nn.Module):
    def __init__(self, c: DraftConfig, w: dict, prefix: str, layer: int, scale: float,
                 value_scale: float = 1.0, cap: float = 0.0):
        super().__init__()
        self.heads, self.kv, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.cap = cap
        if cap:
            scale /= cap
        self.first = layer * c.num_kv_heads  # this layer's rows in the caches
        self.eps = c.rms_norm_eps
        self.qk_norm = f"{prefix}q_norm.weight" in w
        if self.qk_norm:  # the scale goes into the query norm's weight, after the norm
            for name, factor in (("q_norm", scale), ("k_norm", 1.0)):
                g = w[f"{prefix}{name}.weight"] * factor
                half = c.head_dim // 2  # the copy's entry i is the head's entry i +- D/2
                pair = np.concatenate([g, g[half:], g[:half]]).astype(np.float32)
                self.register_buffer(name, torch.from_numpy(pair).reshape(1, -1, 1, 1))
            scale = 1.0

        def rotated(name: str, heads: int, factor: float = 1.0) -> nn.Conv2d:
            bias = w.get(f"{prefix}{name}.bias")
            return conv(with_rotation(w[f"{prefix}{name}.weight"] * factor, heads, c.head_dim),
                        None if bias is None else with_rotation(bias * factor, heads, c.head_dim))

        def scaled(name: str, factor: float) -> nn.Conv2d:
            bias = w.get(f"{prefix}{name}.bias")
            return conv(w[f"{prefix}{name}.weight"] * factor,
                        None if bias is None else bias * factor)

        self.q_proj = rotated("q_proj", c.num_heads, scale)
        self.k_proj = rotated("k_proj", c.num_kv_heads)
        self.v_proj = scaled("v_proj", value_scale)
        self.o_proj = scaled("o_proj", 1.0)

    def _normed(self, pair: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A head and its rotated copy (1, 2D, 1, S), RMS-normed by the head's own RMS."""
        return pair * inverse_rms(pair[:, : self.dim], self.eps) * weight

    def forward(self, x, cos, sin, mask, pos, k_cache, v_cache):
        D, kv, s = self.dim, self.kv, x.shape[3]
        if self.qk_norm:
            qs = [h for p in self.q_proj(x).split(2 * D, dim=1)
                  for h in self._normed(p, self.q_norm).split(D, dim=1)]
            ks = [h for p in self.k_proj(x).split(2 * D, dim=1)
                  for h in self._normed(p, self.k_norm).split(D, dim=1)]
        else:
            qs = self.q_proj(x).split(D, dim=1)
            ks = self.k_proj(x).split(D, dim=1)
        q = [qs[2 * h] * cos + qs[2 * h + 1] * sin for h in range(self.heads)]
        k = torch.cat([ks[2 * g] * cos + ks[2 * g + 1] * sin for g in range(kv)], dim=0)
        v = self.v_proj(x).reshape(kv, D, 1, s)
        rows = slice(self.first, self.first + kv)
        k_cache[rows, pos : pos + s] = k.permute(0, 3, 2, 1).to(k_cache.dtype)
        v_cache[rows, pos : pos + s] = v.permute(0, 3, 2, 1).to(v_cache.dtype)
        L = k_cache.shape[1]
        out = []
        for g in range(kv):
            keys = k_cache[self.first + g : self.first + g + 1].to(x.dtype)  # (1, L, 1, D)
            values = v_cache[self.first + g : self.first + g + 1].to(x.dtype).reshape(1, 1, L, D)
            for h in range(g * self.heads // kv, (g + 1) * self.heads // kv):
                scores = torch.einsum("bkhc,bchq->bkhq", keys, q[h])  # (1, L, 1, S)
                if self.cap:
                    scores = torch.tanh(scores) * self.cap
                scores = scores + mask
                weights = torch.softmax(scores, dim=1).reshape(1, 1, L, s)
                # values^T @ weights: coremltools lowers this einsum to matmul(transpose_x).
                summed = torch.einsum("bhkc,bhkq->bhcq", values, weights)  # (1, 1, D, S)
                out.append(summed.reshape(1, D, 1, s))
        return self.o_proj(torch.cat(out, dim=1))


class MLP(nn.Module):
    def __init__(self, w: dict, prefix: str, activation: str, up_scale: float = 1.0):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            factor = up_scale if name == "up_proj" else 1.0
            bias = w.get(f"{prefix}{name}.bias")
            setattr(self, name, conv(w[f"{prefix}{name}.weight"] * factor,
                                     None if bias is None else bias * factor))
        self.gelu = activation == "gelu_tanh"

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = (nn.functional.gelu(gate, approximate="tanh") if self.gelu
                else nn.functional.silu(gate))
        return self.down_proj(gate * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: DraftConfig, form: Form, w: dict, i: int):
        super().__init__()
        p = f"layers.{i}."
        self.rope, self.windowed = form.layer_rope[i], bool(form.layer_window[i])
        self.sandwich = p + "pre_feedforward_layernorm.weight" in w
        # Gemma's: the stream and the sublayers' outputs before their post-norms are carried
        # at SANDWICH_SCALE (what reads them is an RMS norm, with its eps scaled alike).
        s = SANDWICH_SCALE if self.sandwich else 1.0
        eps = c.rms_norm_eps

        def norm(name: str, factor: float = 1.0, eps: float = eps) -> RMSNorm:
            return RMSNorm(w[p + name + ".weight"] * factor, eps)

        self.self_attn = Attention(c, w, p + "self_attn.", i, form.layer_scale[i], s,
                                   form.attention_cap)
        self.mlp = MLP(w, p + "mlp.", form.activation, s)
        self.input_layernorm = norm("input_layernorm", eps=eps * s * s)
        if self.sandwich:
            self.post_attention_layernorm = norm("post_attention_layernorm", s, eps * s * s)
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm", eps=eps * s * s)
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm", s, eps * s * s)
        else:
            self.post_attention_layernorm = norm("post_attention_layernorm")
        # EAGLE-3's first layer: attention reads [normed embedding, normed feature].
        self.hidden_norm = norm("hidden_norm") if p + "hidden_norm.weight" in w else None
        self.norm_before_residual = form.norm_before_residual

    def forward(self, x, cos, sin, mask, pos, k_cache, v_cache, feature=None):
        if self.hidden_norm is not None:
            normed = self.hidden_norm(feature)
            r = self.self_attn(torch.cat([self.input_layernorm(x), normed], dim=1), cos, sin,
                               mask, pos, k_cache, v_cache)
            h = (normed if self.norm_before_residual else feature) + r
            return h + self.mlp(self.post_attention_layernorm(h))
        r = self.self_attn(self.input_layernorm(x), cos, sin, mask, pos, k_cache, v_cache)
        if not self.sandwich:
            h = x + r
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(r)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Features(nn.Module):
    """A feature-conditioned draft's input mixing (draft/net.py): each token's feature is the
    target's hidden states fused into one vector, or the host's own vector, chosen per token
    by a 0/1 input (a multiply-add: no data-dependent control flow in the package)."""

    def __init__(self, c: DraftConfig, w: dict):
        super().__init__()
        self.size = c.feature_size
        self.norms = nn.ModuleList(RMSNorm(w[f"feature_norms.{i}.weight"], c.rms_norm_eps)
                                   for i in range(len(c.feature_layers)))
        self.fuse = conv(w["fuse.weight"])
        self.norm = RMSNorm(w["feature_norm.weight"], c.rms_norm_eps)
        self.mix = conv(w["mix.weight"])

    def forward(self, x, target_features, own_features, from_target):
        parts = target_features.split(self.size, dim=1)
        fused = self.fuse(torch.cat([n(p) for n, p in zip(self.norms, parts)], dim=1))
        fed = from_target * fused + (1 - from_target) * own_features
        return self.mix(torch.cat([self.norm(fed), x], dim=1)), fed


class EagleFeatures(nn.Module):
    """An EAGLE-3 head's feature (draft/eagle3.py): the target's states, normed as the head
    says and mapped by `fc`, or the host's own vector, chosen per token as in Features."""

    def __init__(self, c: DraftConfig, w: dict):
        super().__init__()
        eps, count = c.rms_norm_eps, len(c.feature_layers)
        self.input_norm = RMSNorm(w["input_norm.weight"], eps) if "input_norm.weight" in w \
            else None
        self.fc_norms = nn.ModuleList(RMSNorm(w[f"fc_norm.{i}.weight"], eps)
                                      for i in range(count) if f"fc_norm.{i}.weight" in w)
        self.size = c.feature_size
        self.fc = conv(w["fc.weight"])

    def forward(self, target_features, own_features, from_target):
        x = target_features if self.input_norm is None else self.input_norm(target_features)
        if len(self.fc_norms):
            x = torch.cat([n(p) for n, p in zip(self.fc_norms, x.split(self.size, dim=1))],
                          dim=1)
        return from_target * self.fc(x) + (1 - from_target) * own_features


class ANEDraft(nn.Module):
    """forward(embeds, rope_cos, rope_sin, mask, write_pos[, window_mask][, target_features,
    own_features, from_target]) -> logits chunks[, top, fed]; the KV cache is the module's
    buffers `k_cache` and `v_cache` (Core ML state)."""

    def __init__(self, spec: PackageSpec, weights: dict[str, np.ndarray]):
        super().__init__()
        spec.check()
        c, form = self.config, self.form = spec.config, spec.form
        self.in_proj = conv(weights["in_proj.weight"]) if "in_proj.weight" in weights else None
        self.eagle3 = form.eagle3
        self.features = (EagleFeatures(c, weights) if self.eagle3 else Features(c, weights)) \
            if spec.reads_features else None
        self.windowed = bool(form.window)
        self.layers = nn.ModuleList(Block(c, form, weights, i) for i in range(c.num_layers))
        stream = SANDWICH_SCALE if any(layer.sandwich for layer in self.layers) else 1.0
        if stream != 1.0 and self.features is not None:
            raise ModelLoadError("a feature draft with gemma's norms is not exported: its "
                                 "outputs would carry the package's scaled residual stream")
        self.embed_scale = form.embed_scale * stream
        # An EAGLE-3 head may have no final norm, or apply it to what it feeds itself (`top`).
        self.norm = RMSNorm(weights["norm.weight"], c.rms_norm_eps * stream * stream) \
            if "norm.weight" in weights else nn.Identity()
        self.out_norm = RMSNorm(weights["out_norm.weight"], c.rms_norm_eps) \
            if "out_norm.weight" in weights else nn.Identity()
        head = weights["embed_tokens.weight" if c.tie_head else "head.weight"]
        bias = weights.get("head.bias")
        bounds = np.cumsum([0, *head_chunks(c.head_size)])
        self.logit_cap = form.logit_cap
        if self.logit_cap:
            head = head / self.logit_cap
            bias = None if bias is None else bias / self.logit_cap
        # The Neural Engine limits every dimension to 16384: a larger head is split in chunks.
        self.heads = nn.ModuleList(
            conv(head[a:b], None if bias is None else bias[a:b])
            for a, b in zip(bounds[:-1], bounds[1:]))
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(spec.state_shape(name), dtype=torch.float16))
        self.eval()

    def forward(self, embeds, rope_cos, rope_sin, mask, write_pos, *rest):
        window_mask = rest[0] if self.windowed else None
        features = rest[1:] if self.windowed else rest
        if self.embed_scale != 1.0:
            embeds = embeds * self.embed_scale
        x = embeds if self.in_proj is None else self.in_proj(embeds)
        fed = None
        if self.eagle3:
            fed = self.features(*features)
        elif self.features is not None:
            x, fed = self.features(x, *features)
        pos = write_pos[0]
        D = self.config.head_dim
        tables = [(rope_cos[:, r * D : (r + 1) * D], rope_sin[:, r * D : (r + 1) * D])
                  for r in range(len(self.form.rope_freqs))]
        for layer in self.layers:
            cos, sin = tables[layer.rope]
            seen = window_mask if layer.windowed else mask
            x = layer(x, cos, sin, seen, pos, self.k_cache, self.v_cache, fed)
        x = self.out_norm(x)
        x_normed = self.norm(x)
        logits = tuple(head(x_normed) for head in self.heads)
        if self.logit_cap:
            logits = tuple(torch.tanh(chunk) * self.logit_cap for chunk in logits)
        return logits + (x, fed) if self.features is not None else logits
