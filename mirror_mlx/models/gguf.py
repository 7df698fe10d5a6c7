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

from ..errors import ModelLoadError

MAGIC = b"GGUF"

# Metadata value types (GGUF spec).
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9

# Tensor types MLX can read: name, elements per block, bytes per block.
# Q4_0, Q4_1 and Q8_0 stay quantized; the others MLX converts to float16 on load.
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}


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
        alignment = int(metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
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
        return GGUFHeader(path, version, metadata, tensors)
    except (struct.error, OverflowError, MemoryError) as e:
        raise ModelLoadError(f"{path}: corrupt GGUF header ({e})") from e


SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> mlx-lm llama parameter path (after "model.layers.N.").
_LAYER_NAMES = {
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
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def llama_config(header: GGUFHeader) -> dict[str, Any]:
    """mlx-lm `ModelArgs` for a llama GGUF, or a clear error for anything else."""
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
        n_heads = int(header.arch_value("attention.head_count"))
        hidden = int(header.arch_value("embedding_length"))
        config = {
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": int(header.arch_value("block_count")),
            "intermediate_size": int(header.arch_value("feed_forward_length")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(header.arch_value("attention.head_count_kv", n_heads)),
            "rms_norm_eps": float(header.arch_value("attention.layer_norm_rms_epsilon")),
            "vocab_size": int(
                header.arch_value("vocab_size", len(header.metadata["tokenizer.ggml.tokens"]))
            ),
            "head_dim": int(header.arch_value("rope.dimension_count", hidden // n_heads)),
            "rope_theta": float(header.arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(header.arch_value("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in header.tensors,
        }
    except (TypeError, KeyError, ValueError) as e:
        raise ModelLoadError(f"{header.path}: llama metadata is incomplete ({e})") from e
    if scaling == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": float(header.arch_value("rope.scaling.factor", 1.0)),
        }
    return config


def mlx_lm_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{index}.{_LAYER_NAMES[part]}.{suffix}"
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
