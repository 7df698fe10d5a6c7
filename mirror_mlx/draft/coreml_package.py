"""What a Core ML draft package holds and promises: its input/output/state names and shapes,
its metadata, and the weights it was made from. The exporter (coreml_export) writes packages to
this contract; the Core ML backend (draft/coreml_draft.py) and the reference executor read them
by it. Nothing here needs torch or coremltools.

The contract, for a draft with N layers, KV heads of width D, context L and query length S (one
of the enumerated sizes):

  inputs   embeds    float32 (1, E, 1, S)  input embeddings, host-computed (see below)
           rope_cos  float32 (1, R * D, 1, S)  cos of each token's rotary angles (both halves),
                                           for each of the draft's R rotary tables (Form)
           rope_sin  float32 (1, R * D, 1, S)
           mask      float32 (1, L, 1, S)  additive: 0 where a token may attend, MASK_VALUE not
           write_pos int32   (1,)          the slot where the S new keys/values are written
           window_mask float32 (1, L, 1, S)  only for drafts with sliding-window layers: `mask`
                                           narrowed to each token's last `window` visible keys
  states   k_cache   fp16 (N * kv_heads, L, 1, D)
           v_cache   fp16 (N * kv_heads, L, 1, D)
  outputs  logits_0 .. logits_{c-1}  fp16 (1, V_i, 1, S): the head's scores in chunks of at
           most MAX_DIM rows, in head order

A draft that reads the target's features (DraftConfig.feature_layers, K layers of width F) has
three more inputs and two more outputs. Each token's feature is either the target's (its hidden
states at the K layers, fused inside the package) or a vector the host keeps (the draft's own
output at an earlier slot, or what a slot was fed), as draft/rollout.py's FeatureRefs say:

  inputs   target_features float32 (1, K * F, 1, S)  the target's K hidden states, concatenated
           own_features    float32 (1, H, 1, S)      the host's feature vector
           from_target     float32 (1, 1, 1, S)      1: read target_features, 0: own_features
  outputs  top   fp16 (1, H, 1, S)  the last layer's output before the final norm: the next
                                    token's feature where the target's is not known
           fed   fp16 (1, H, 1, S)  the feature each token was fed (to feed it again later)

An EAGLE-3 head (Form.eagle3) has the same inputs and outputs: its feature is its `fc` of the
target's states (or the host's vector), read by its first layer beside the embedding; the host
hides key 0 from later tokens in `mask`, as the head's MLX form does.

The embedding lookup happens on the host, in MLX, from the target's own table: the draft reads
the target's embedding (49152 x 576 for the default target), so doing the lookup in the package
would duplicate 56 MB of weights and put a large gather on the Neural Engine. The draft's own
input projection (when its width differs from the embedding's) is inside the package.

Rotary angles are computed on the host in float64: in fp16 on the device, position * frequency
loses the position's low bits beyond ~2048. A rope scaling (linear, llama3, yarn, ...) is only
other frequencies, so the host's tables carry it, and the package needs none of its own.

The host divides each of the target's hidden states by its root mean square (float32) before it
enters the package, where the package reads them through an RMS norm first (Form.feature_norm),
which that division does not change: Gemma's pass float16's 65,504 (see `unit_rms`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import IncompatibleDraft, InvalidParameter, ModelLoadError
from .net import DraftConfig, DraftNet

FORMAT = "mirror-mlx-coreml-draft/3"  # 3: the family form (rope tables, windows, norms)
MAX_DIM = 16384  # the Neural Engine's practical limit on any one dimension (APPLE_APIS 2.2)
# A stateful package whose state's dimensions are not multiples of 32 fails on the Neural
# Engine while it runs on the CPU and GPU (coremltools #2631): context and head_dim must be.
STATE_ALIGN = 32
MASK_VALUE = -1e4  # fp16-safe "minus infinity": a fully masked (padding) row stays finite
INPUTS = ("embeds", "rope_cos", "rope_sin", "mask", "write_pos")
WINDOW_INPUT = "window_mask"
FEATURE_INPUTS = ("target_features", "own_features", "from_target")
FEATURE_OUTPUTS = ("top", "fed")
# Core ML keeps an input's memory bound after predict returns and releases it about a second
# later on a queue of its own (APPLE_APIS fact 2): an input must stay untouched, and
# alive, this long after the call that was given it.
INPUT_HOLD_S = 2.0
STATES = ("k_cache", "v_cache")
COMPUTE_UNITS = "CPU_AND_NE"  # Core ML does not store the units in a package: this key does
META = "mirror_mlx."  # prefix of our keys in the package's user-defined metadata


def head_chunks(head_size: int) -> list[int]:
    """Rows per logits output: equal chunks of at most MAX_DIM."""
    n = -(-head_size // MAX_DIM)
    base, extra = divmod(head_size, n)
    return [base + (i < extra) for i in range(n)]


def query_sizes(max_tokens: int) -> tuple[int, ...]:
    """The enumerated query lengths: powers of two below `max_tokens`, and `max_tokens`."""
    if max_tokens < 1:
        raise InvalidParameter(f"max-branch-tokens must be at least 1 (got {max_tokens})")
    sizes, s = [], 1
    while s < max_tokens:
        sizes.append(s)
        s *= 2
    return (*sizes, max_tokens)


# The MLPs of the families drafts come from, by the module that defines them: each gates with
# SiLU but gemma's, which gates with tanh-approximated GELU (one MIL op, on the Neural Engine).
ACTIVATIONS = {"mirror_mlx.draft.net": "silu", "mlx_lm.models.llama": "silu",
               "mlx_lm.models.qwen2": "silu", "mlx_lm.models.qwen3": "silu",
               "mlx_lm.models.phi3": "silu",
               "mlx_lm.models.gemma2": "gelu_tanh", "mlx_lm.models.gemma3_text": "gelu_tanh"}
# Gemma's RMSNorm scales by 1 + weight: the package stores that sum as the weight.
GEMMA_NORMS = ("mlx_lm.models.gemma2", "mlx_lm.models.gemma3_text")


@dataclass
class Form:
    """What a package's layers compute beyond what DraftConfig describes; the plain llama form
    is `Form.plain`. Biases, qk-norm and gemma's sandwich norms need no entry: the weights have
    them (see `draft_weights`)."""

    rope_freqs: list[list[float]]  # each rotary table: head_dim / 2 angles per position
    layer_rope: list[int]  # per layer: its rotary table
    layer_scale: list[float]  # per layer: the attention scale (yarn's mscale folded in)
    layer_window: list[int]  # per layer: its sliding window, 0 for none
    activation: str = "silu"  # the MLP's gate: silu, or gelu_tanh (gemma)
    embed_scale: float = 1.0  # what the input embeddings are multiplied by (gemma)
    # An EAGLE-3 head (draft/eagle3.py): its first layer reads the embedding beside the feature,
    # key 0 is hidden from later tokens, and the residual starts from the feature (normed
    # first with `norm_before_residual`); its feature norms and output norms are in the weights.
    eagle3: bool = False
    norm_before_residual: bool = False
    # The package's first operation on the target's features: an RMS norm of each layer's
    # (layers), of the whole row (whole: speculators' norm_before_fc), or none (a head that
    # reads them through `fc` alone).
    feature_norm: str = "layers"
    attention_cap: float = 0.0  # gemma 2's soft cap on attention scores (cap * tanh(s / cap))
    logit_cap: float = 0.0  # gemma 2's soft cap on the final logits

    @staticmethod
    def plain(c: DraftConfig) -> Form:
        return Form([rope_frequencies(c.head_dim, c.rope_theta).tolist()], [0] * c.num_layers,
                    [c.head_dim**-0.5] * c.num_layers, [0] * c.num_layers)

    @property
    def window(self) -> int:
        """The sliding window of the windowed layers (one for all), 0 if none has one."""
        return max(self.layer_window, default=0)


def rope_frequencies(head_dim: int, base: float, scale: float = 1.0) -> np.ndarray:
    return scale * base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _rotary(rotate: nn.Module, head_dim: int) -> tuple[list[float], float] | str:
    """A rope module of mlx-lm's -> (its frequencies, the factor it scales q and k by), or
    why the package cannot compute it. Every scaled rope mlx-lm has (linear, llama3, yarn,
    longrope, proportional) is plain rope at other frequencies (`_freqs`, the periods)."""
    dims = getattr(rotate, "dims", getattr(rotate, "dim", None))
    if getattr(rotate, "traditional", False):
        return "traditional (interleaved) rope"
    if dims != head_dim:
        return f"partial rope ({dims} of {head_dim} dimensions rotated)"
    if type(rotate) is nn.RoPE:
        return rope_frequencies(head_dim, rotate.base, rotate.scale).tolist(), 1.0
    periods = getattr(rotate, "_freqs", None)
    if not isinstance(periods, mx.array):
        return f"{type(rotate).__name__} rope"
    factor = float(getattr(rotate, "mscale", getattr(rotate, "_scale", 1.0)))
    return (1.0 / np.array(periods.astype(mx.float32), np.float64)).tolist(), factor


def form_of(net: DraftNet) -> Form:
    """The form a package of `net` computes; IncompatibleDraft names what it cannot."""
    why: list[str] = []
    eagle3 = bool(net.layers) and "hidden_norm" in net.layers[0]
    if not net.config.shared_embedding:
        why.append("an input embedding of its own (the host gives the package the target's "
                   "rows)")
    tables: list[list[float]] = []
    layer_rope, layer_scale, layer_window, activations = [], [], [], set()
    for layer in net.layers:
        attn, mlp = layer.self_attn, layer.mlp
        rotary = _rotary(attn.rope, net.config.head_dim)
        if isinstance(rotary, str):
            why.append(rotary)
            rotary = ([], 1.0)
        freqs, factor = rotary
        if freqs not in tables:
            tables.append(freqs)
        layer_rope.append(tables.index(freqs))
        # yarn scales q and k by mscale before rotating: their product, by its square.
        layer_scale.append(float(attn.scale) * factor * factor)
        layer_window.append(attn.window or 0)
        if "qkv_proj" in attn:
            why.append("a fused qkv projection")
        if "gate_up_proj" in mlp:
            why.append("a fused gate/up projection")
        kind = ACTIVATIONS.get(type(mlp).__module__)
        if kind is None:
            why.append(f"an MLP of {type(mlp).__module__}")
        activations.add(kind)
    caps = {float(layer.self_attn.softcap) for layer in net.layers}
    if len(caps) > 1:
        why.append("attention soft caps that differ by layer")
    if len({w for w in layer_window if w}) > 1:
        why.append("sliding windows of several sizes")
    if why:
        raise IncompatibleDraft("the Core ML draft cannot compute "
                                + ", ".join(dict.fromkeys(why)) + " (run it with MLX instead)")
    scale = net._embed_scale
    if not eagle3:
        feature_norm = "layers"  # feature_norms (net.py)
    else:
        feature_norm = ("whole" if "input_norm" in net else "layers" if "fc_norm" in net
                        else "none")
    return Form(tables, layer_rope, layer_scale, layer_window, activations.pop(),
                1.0 if scale is None else float(scale.astype(mx.float32).item()), eagle3,
                eagle3 and net.layers[0].norm_before_residual, feature_norm,
                max(caps, default=0.0), float(net._logit_cap))


@dataclass
class PackageSpec:
    """Everything about a package that its user needs, stored in its metadata."""

    config: DraftConfig
    context: int  # L: KV slots in the state
    query_sizes: tuple[int, ...]  # enumerated S, ascending
    weights_sha256: str = ""
    source: str = ""  # the draft spec it was exported from
    source_sha256: str = ""  # of the files the source was loaded from (see source_sha256)
    compress: str = "none"
    compute_units: str = COMPUTE_UNITS
    extra: dict = field(default_factory=dict)
    form: Form | None = None  # None: Form.plain(config)

    def __post_init__(self):
        if self.form is None:
            self.form = Form.plain(self.config)

    @property
    def kv_heads(self) -> int:
        return self.config.num_layers * self.config.num_kv_heads

    @property
    def reads_features(self) -> bool:
        return bool(self.config.feature_layers)

    @property
    def feature_parts(self) -> int:
        """Into how many parts the host divides a target feature row, each by its RMS (see
        `unit_rms`): what the package's first RMS norm on the row reads (0: it has none)."""
        return {"layers": len(self.config.feature_layers), "whole": 1, "none": 0}[
            self.form.feature_norm]

    @property
    def inputs(self) -> tuple[str, ...]:
        return (INPUTS + ((WINDOW_INPUT,) if self.form.window else ())
                + (FEATURE_INPUTS if self.reads_features else ()))

    @property
    def outputs(self) -> list[str]:
        logits = [f"logits_{i}" for i in range(len(head_chunks(self.config.head_size)))]
        return logits + list(FEATURE_OUTPUTS) if self.reads_features else logits

    def input_shape(self, name: str, s: int) -> tuple[int, ...]:
        c = self.config
        tables = len(self.form.rope_freqs) * c.head_dim
        return {"embeds": (1, c.embed_size, 1, s), "rope_cos": (1, tables, 1, s),
                "rope_sin": (1, tables, 1, s), "mask": (1, self.context, 1, s),
                "write_pos": (1,), WINDOW_INPUT: (1, self.context, 1, s),
                "target_features": (1, len(c.feature_layers) * c.feature_size, 1, s),
                "own_features": (1, c.hidden_size, 1, s), "from_target": (1, 1, 1, s)}[name]

    @staticmethod
    def input_dtype(name: str) -> type:
        return np.int32 if name == "write_pos" else np.float32

    def state_shape(self, name: str) -> tuple[int, ...]:
        return (self.kv_heads, self.context, 1, self.config.head_dim)

    def check(self) -> None:
        c = self.config
        if c.stream_count:
            raise ModelLoadError("drafts with speculative streams are not exported to Core ML "
                                 "yet: their stream positions are an MLX-only path")
        if c.head_dim % STATE_ALIGN:
            raise ModelLoadError(
                f"head_dim {c.head_dim} is not a multiple of {STATE_ALIGN}: the KV cache state "
                "would not run on the Neural Engine (run this draft with MLX)")
        if not 0 < self.context <= MAX_DIM or self.context % STATE_ALIGN:
            raise InvalidParameter(f"context must be a multiple of {STATE_ALIGN} in "
                                   f"{STATE_ALIGN}..{MAX_DIM} (got {self.context}): the Neural "
                                   "Engine fails on other state sizes")
        if max(self.query_sizes) > self.context:
            raise InvalidParameter("max-branch-tokens cannot exceed the context")
        f = self.form
        if not (len(f.layer_rope) == len(f.layer_scale) == len(f.layer_window) == c.num_layers
                and all(len(t) * 2 == c.head_dim for t in f.rope_freqs)):
            raise ModelLoadError("the package's form does not match its draft config")
        if len({w for w in f.layer_window if w}) > 1:
            raise ModelLoadError("a package takes one sliding window size (one window mask)")
        if max(c.embed_size, c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim,
               len(c.feature_layers) * c.feature_size) > MAX_DIM:
            raise ModelLoadError(f"a draft wider than {MAX_DIM} does not fit the Neural Engine")

    def to_metadata(self) -> dict[str, str]:
        return {
            META + "format": FORMAT,
            META + "source": self.source,
            META + "vocab_size": str(self.config.vocab_size),
            META + "head_size": str(self.config.head_size),
            META + "context": str(self.context),
            META + "query_sizes": ",".join(map(str, self.query_sizes)),
            META + "weights_sha256": self.weights_sha256,
            META + "source_sha256": self.source_sha256,
            META + "compress": self.compress,
            META + "compute_units": self.compute_units,
            META + "draft_config": json.dumps(asdict(self.config), separators=(",", ":")),
            META + "form": json.dumps(asdict(self.form), separators=(",", ":")),
            **{META + k: str(v) for k, v in self.extra.items()},
        }

    @staticmethod
    def from_metadata(meta: dict[str, str], where: str = "package") -> PackageSpec:
        found = meta.get(META + "format", "")
        if found != FORMAT:
            if found.startswith(FORMAT.rsplit("/", 1)[0]):
                raise ModelLoadError(f"{where}: made by another mirror-mlx version ({found}, "
                                     f"this one reads {FORMAT}); export it again with "
                                     "`mirror-mlx export-draft`")
            raise ModelLoadError(f"{where}: not a mirror-mlx draft package (no {FORMAT} "
                                 "metadata); export one with `mirror-mlx export-draft`")
        try:
            return PackageSpec(
                config=DraftConfig(**json.loads(meta[META + "draft_config"])),
                context=int(meta[META + "context"]),
                query_sizes=tuple(int(s) for s in meta[META + "query_sizes"].split(",")),
                weights_sha256=meta[META + "weights_sha256"],
                source=meta[META + "source"],
                source_sha256=meta[META + "source_sha256"],
                compress=meta[META + "compress"],
                compute_units=meta[META + "compute_units"],
                form=Form(**json.loads(meta[META + "form"])),
            )
        except (KeyError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{where}: damaged draft metadata ({e})") from e


def draft_weights(net: DraftNet) -> dict[str, np.ndarray]:
    """The weights a package holds, float32 and dequantized, under the DraftNet's names: every
    layer, the final norm, the input projection, and the head (the shared embedding when the
    head is tied to it). Every norm's weight is the factor it scales by (gemma's 1 + w)."""
    config = net.config
    out = {}
    for name, module in net.named_modules():
        if name == "embed_tokens" and not config.tie_head:
            continue
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.get("biases"),
                              module.group_size, module.bits, mode=module.mode, stream=mx.cpu)
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.RMSNorm)):
            w = module.weight
        elif type(module).__name__ == "RMSNorm" and type(module).__module__ in GEMMA_NORMS:
            w = 1.0 + module.weight  # in the weight's dtype, as gemma's norm computes it
        else:
            continue
        out[f"{name}.weight"] = np.array(w.astype(mx.float32), copy=True)
        if "bias" in module:
            out[f"{name}.bias"] = np.array(module.bias.astype(mx.float32), copy=True)
    return out


def weights_sha256(weights: dict[str, np.ndarray]) -> str:
    """A hash of the weights as the package stores them (fp16): what the package computes
    with, so a reference run can check it has the same weights."""
    h = hashlib.sha256()
    for name in sorted(weights):
        w = np.ascontiguousarray(weights[name], dtype=np.float16)
        h.update(f"{name}:{w.shape};".encode())
        h.update(w.tobytes())
    return h.hexdigest()


def source_sha256(path: Path) -> str:
    """A hash of the files a draft is loaded from (a file, or a folder's files outside any
    .mlpackage in it). Unlike the weights in memory, which depend on the dtype policy and on
    how each platform dequantizes, the files are the same everywhere: this is what matches a
    package to the draft beside it."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(f for f in path.rglob("*") if f.is_file() and not any(
            part.endswith(".mlpackage") for part in f.relative_to(path).parts))
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(path) if f != path else f.name}:".encode())
        with open(f, "rb") as stream:
            while block := stream.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def rope_tables(positions: np.ndarray, form: Form) -> tuple[np.ndarray, ...]:
    """(cos, sin), each (len(positions), R * head_dim) for the form's R rotary tables, for
    non-traditional rotary embedding: the pairs are (i, i + head_dim / 2), so both halves
    share one angle."""
    pos = np.asarray(positions, dtype=np.float64)[:, None]
    angles = [pos * np.asarray(freqs)[None, :] for freqs in form.rope_freqs]
    angles = np.concatenate([a for table in angles for a in (table, table)], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def window_visible(visible: np.ndarray, window: int) -> np.ndarray:
    """`visible` (queries, keys) narrowed to each query's last `window` visible keys, as the
    draft's windowed layers see them (net.windowed)."""
    return visible & (np.cumsum(visible[:, ::-1], axis=1)[:, ::-1] <= window)


def unit_rms(rows: np.ndarray, parts: int) -> np.ndarray:
    """Target feature rows (n, parts * F), each part divided by its root mean square in float32,
    as training stores them (train/feature.py). The package reads each part through an RMS norm
    first, which a positive factor leaves as it is up to that norm's eps (relative eps / 2 /
    rms^2 here, far below float16's resolution for hidden states), and the rows then fit float16
    (every entry within sqrt(F)), however far the target's states pass 65,504."""
    n = rows.shape[0]
    split = rows.astype(np.float32).reshape(n, parts, -1)
    scale = 1.0 / np.sqrt(np.mean(split * split, axis=-1, keepdims=True) + 1e-12)
    return (split * scale).reshape(n, -1)
