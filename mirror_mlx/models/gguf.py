"""GGUF files: header validation, metadata, and the mapping of llama tensors onto mlx-lm's model.

MLX's own GGUF reader trusts the file; a truncated or corrupt header can crash the process.
So every file is parsed and checked here first, in Python, with each length and offset bounded
by the file's size, before `mx.load` sees it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError

MAGIC = b"GGUF"

# Metadata value types (GGUF spec).
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9

# Tensor types we load: name, elements per block, bytes per block.
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
# The types MLX's own reader takes (Q4_0, Q4_1 and Q8_0 stay quantized; it converts the others
# to float16). Files with any other type, such as the Q5_0 that llama.cpp's K-quant mixes use
# for rows not a multiple of 256, are dequantized with the `gguf` package instead.
MLX_READS = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                       "Q6_K"})


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int  # byte offset of the tensor data section

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Reader:
    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({what})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} runs past the end of the file at byte {self.pos}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8") from e

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if itype in _SCALARS:
                size = struct.calcsize(_SCALARS[itype])
                raw = self.take(count * size, what)
                return list(struct.unpack(f"<{count}{_SCALARS[itype][1]}", raw))
            if itype == _STRING:
                # Each string needs at least its 8-byte length: bound count before looping.
                if count * 8 > len(self.buf) - self.pos:
                    raise self.fail(f"{what} claims {count} strings")
                return [self.string(what) for _ in range(count)]
            raise self.fail(f"{what} has unsupported array item type {itype}")
        raise self.fail(f"{what} has unknown value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse and validate a GGUF file's header and tensor table without loading tensors."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(mm, path, size)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from e


def _parse(buf: mmap.mmap, path: Path, size: int) -> GGUFHeader:
    try:
        r = _Reader(buf, path)
        if r.take(4, "magic") != MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic bytes)")
        version = r.scalar("<I", "version")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors = r.scalar("<Q", "tensor count")
        n_kv = r.scalar("<Q", "metadata count")
        if n_tensors > size // 24 or n_kv > size // 12:
            raise r.fail(f"claims {n_tensors} tensors and {n_kv} metadata entries")
        metadata = {}
        for i in range(n_kv):
            key = r.string(f"metadata key {i}")
            metadata[key] = r.value(r.scalar("<I", key), f"metadata '{key}'")
        infos = []
        for i in range(n_tensors):
            name = r.string(f"tensor name {i}")
            n_dims = r.scalar("<I", name)
            if not 1 <= n_dims <= 4:
                raise r.fail(f"tensor '{name}' has {n_dims} dimensions")
            shape = tuple(r.scalar("<Q", name) for _ in range(n_dims))
            ttype = r.scalar("<I", name)
            offset = r.scalar("<Q", name)
            infos.append((name, shape, ttype, offset))
        alignment = metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise r.fail(f"alignment {alignment} is not a power of two")
        data_start = (r.pos + alignment - 1) // alignment * alignment
        tensors = {}
        for name, shape, ttype, offset in infos:
            if ttype not in TENSOR_TYPES:
                raise ModelLoadError(
                    f"{path}: tensor '{name}' has GGUF type {ttype}, which is not supported "
                    f"(supported: {', '.join(t[0] for t in TENSOR_TYPES.values())})"
                )
            type_name, block, block_bytes = TENSOR_TYPES[ttype]
            count = 1
            for d in shape:
                count *= d
            if shape[0] % block:
                raise r.fail(f"tensor '{name}' row of {shape[0]} is not a multiple of {block}")
            nbytes = count // block * block_bytes
            if offset % alignment or data_start + offset + nbytes > size:
                raise r.fail(
                    f"tensor '{name}' ({nbytes} bytes at offset {offset}) lies outside the "
                    f"{size}-byte file"
                )
            tensors[name] = TensorInfo(name, shape, type_name, offset, nbytes)
        _check_packing(r, list(tensors.values()), alignment, data_start, size)
        return GGUFHeader(path, version, metadata, tensors, data_start)
    except (struct.error, OverflowError, MemoryError) as e:
        raise ModelLoadError(f"{path}: corrupt GGUF header ({e})") from e


def _check_packing(r: _Reader, tensors: list[TensorInfo], alignment: int, data_start: int,
                   size: int) -> None:
    """Writers lay tensors end to end, each padded to the alignment, the last at the file's
    end: a tensor that overlaps the next or leaves a gap has a type or shape that misstates
    its size (F16 bytes read as Q4_0 would load, as garbage)."""
    tensors = sorted(tensors, key=lambda t: t.offset)
    if tensors:
        last = tensors[-1]
        tail = size - (data_start + last.offset + last.nbytes)
        if not 0 <= tail < alignment:
            raise r.fail(f"tensor '{last.name}' ({last.type_name}, shape {last.shape}: "
                         f"{last.nbytes} bytes) ends {tail} bytes before the file does")
    for t, after in zip(tensors, tensors[1:]):
        end = (t.offset + t.nbytes + alignment - 1) // alignment * alignment
        if end != after.offset:
            raise r.fail(f"tensor '{t.name}' ({t.type_name}, shape {t.shape}: {t.nbytes} "
                         f"bytes at offset {t.offset}) does not end where '{after.name}' "
                         f"begins (offset {after.offset})")


def load_tensors(header: GGUFHeader) -> dict[str, mx.array]:
    """Every tensor of a validated file, by GGUF name. MLX's reader where it takes every type
    in the file; otherwise each tensor is dequantized to float32 from the bytes the header
    placed (offsets already bounded by the file's size)."""
    if all(t.type_name in MLX_READS for t in header.tensors.values()):
        try:
            return mx.load(str(header.path))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{header.path}: MLX could not read the tensors ({e})") from e
    from gguf import GGMLQuantizationType, quants

    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    out = {}
    for t in header.tensors.values():
        start = header.data_start + t.offset
        # numpy order is GGUF's reversed; the last axis holds one row's bytes.
        raw = np.asarray(data[start : start + t.nbytes]).reshape(*reversed(t.shape[1:]), -1)
        out[t.name] = mx.array(quants.dequantize(raw, GGMLQuantizationType[t.type_name]))
    return out


SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# GGUF tensor name (after "blk.N.") -> mlx-lm parameter path (after "model.layers.N.").
_LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 norms the attention's and the MLP's input and output, and each head's q and k; its
# "post_attention_layernorm" is the attention's output norm, not llama's pre-MLP norm.
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LLAMA_LAYER_NAMES.items() if k.startswith(("attn_", "ffn_"))},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAMES = {"llama": _LLAMA_LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def model_config(header: GGUFHeader) -> dict[str, Any]:
    """mlx-lm `ModelArgs` for a supported GGUF, or a clear error for anything else."""
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{header.path}: architecture '{arch or 'missing'}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    scaling = header.arch_value("rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in header.tensors:
        raise ModelLoadError(f"{header.path}: rope scaling '{scaling}' is not supported")
    try:
        config = _llama_config(header) if arch == "llama" else _gemma3_config(header)
        if scaling == "linear":
            config["rope_scaling"] = {
                "type": "linear",
                "factor": float(header.arch_value("rope.scaling.factor", 1.0)),
            }
    except (TypeError, KeyError, ValueError, ArithmeticError) as e:
        raise ModelLoadError(f"{header.path}: {arch} metadata is incomplete ({e})") from e
    _check_config(header, config)
    return config


def _check_config(header: GGUFHeader, config: dict[str, Any]) -> None:
    """Sizes that agree with the tensor table, and numbers a model can run with, before a
    model is built from them: a layer count of 2^40 would build for ever, a NaN epsilon or
    rope base would decode garbage without an error."""
    def bad(what: str) -> ModelLoadError:
        return ModelLoadError(f"{header.path}: {header.architecture} metadata is wrong ({what})")

    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"):
        if not 0 < config[key] < 2**31:
            raise bad(f"{key} is {config[key]}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise bad(f"{config['num_attention_heads']} heads do not share "
                  f"{config['num_key_value_heads']} KV heads evenly")
    numbers = {"rms_norm_eps": config["rms_norm_eps"], "rope_theta": config["rope_theta"],
               "rope scaling factor": config.get("rope_scaling", {}).get("factor", 1.0)}
    for key, v in numbers.items():
        if not 0 < v < float("inf"):
            raise bad(f"{key} is {v}")
    layers = {name.split(".")[1] for name in header.tensors if name.startswith("blk.")}
    if len(layers) != config["num_hidden_layers"]:
        raise bad(f"block_count is {config['num_hidden_layers']}, the file has tensors for "
                  f"{len(layers)} layers")
    embedding = header.tensors.get("token_embd.weight")
    if embedding is None:
        raise bad("no token_embd.weight tensor")
    if embedding.shape != (config["hidden_size"], config["vocab_size"]):
        raise bad(f"token_embd.weight is {embedding.shape}, the metadata makes it "
                  f"({config['hidden_size']}, {config['vocab_size']})")
    for key in ("bos", "eos", "eot", "unknown", "padding"):
        token = header.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None and not (type(token) is int and 0 <= token < config["vocab_size"]):
            raise bad(f"tokenizer.ggml.{key}_token_id {token!r} is not a token id below "
                      f"{config['vocab_size']}")
    template = header.metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise bad("tokenizer.chat_template is not text")
    up = header.tensors.get("blk.0.ffn_up.weight")
    if up is not None and up.shape[-1] != config["intermediate_size"]:
        raise bad(f"feed_forward_length is {config['intermediate_size']}, blk.0.ffn_up.weight "
                  f"is {up.shape}")


def _common_config(header: GGUFHeader) -> dict[str, Any]:
    n_heads = int(header.arch_value("attention.head_count"))
    return {
        "hidden_size": int(header.arch_value("embedding_length")),
        "num_hidden_layers": int(header.arch_value("block_count")),
        "intermediate_size": int(header.arch_value("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(header.arch_value("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(header.arch_value("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(
            header.arch_value("vocab_size", len(header.metadata["tokenizer.ggml.tokens"]))
        ),
        "max_position_embeddings": int(header.arch_value("context_length", 2048)),
    }


def _llama_config(header: GGUFHeader) -> dict[str, Any]:
    config = _common_config(header)
    config.update(
        model_type="llama",
        head_dim=int(header.arch_value(
            "rope.dimension_count", config["hidden_size"] // config["num_attention_heads"])),
        rope_theta=float(header.arch_value("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in header.tensors,
    )
    return config


def _gemma3_config(header: GGUFHeader) -> dict[str, Any]:
    config = _common_config(header)
    head_dim = int(header.arch_value("attention.key_length", 256))
    config.update(
        model_type="gemma3_text",
        head_dim=head_dim,
        rope_theta=float(header.arch_value("rope.freq_base", 1_000_000.0)),
        sliding_window=int(header.arch_value("attention.sliding_window", 512)),
        # GGUF stores neither of these for gemma3: llama.cpp fixes them in code (five local
        # layers per global one; local rope base 10000), and so do we.
        sliding_window_pattern=6,
        rope_local_base_freq=10_000.0,
        # llama.cpp's rule: queries scale by 1/sqrt(head_dim), except the 62-layer 27B, which
        # scales by 1/sqrt(hidden / heads).
        query_pre_attn_scalar=float(
            config["hidden_size"] // config["num_attention_heads"]
            if config["num_hidden_layers"] == 62 else head_dim),
    )
    return config


def to_mlx_lm(header: GGUFHeader, config: dict[str, Any],
              raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """The file's tensors under mlx-lm's parameter names, in mlx-lm's conventions."""
    arch = header.architecture
    weights: dict[str, mx.array] = {}
    for key, value in raw.items():
        # mx.load splits a quantized tensor into "<name>.weight/.scales/.biases".
        target = mlx_lm_name(key, arch)
        if target is None:
            raise ModelLoadError(f"{header.path}: unexpected tensor '{key}' for a {arch} model")
        if arch == "llama" and ".q_proj." in target:
            value = unpermute_rows(value, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in target:
            value = unpermute_rows(value, config["num_key_value_heads"])
        elif arch == "gemma3" and target.endswith("norm.weight"):
            # llama.cpp stores Gemma's RMSNorm scale as 1 + w; mlx-lm adds the 1 itself.
            value = value - 1.0
        weights[target] = value
    return weights


def mlx_lm_name(gguf_name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        names = _LAYER_NAMES[arch]
        if part in names:
            return f"model.layers.{index}.{names[part]}.{suffix}"
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    return None


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's reordering of q/k rows for its rotary layout.

    llama.cpp interleaves each head's two rotary halves; mlx-lm (like Hugging Face) keeps them
    as halves. Rows only move, so this applies unchanged to quantized weights, scales and biases.
    """
    rows = w.shape[0]
    head = rows // n_heads
    return (
        w.reshape(n_heads, head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows, *w.shape[1:])
    )
