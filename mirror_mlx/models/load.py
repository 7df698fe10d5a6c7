"""One entry point for every model spec: a local mlx-lm directory, a Hugging Face repo id,
a .gguf file, or a hosted model's name ("default", "gemma3-270m"). Returns the mlx-lm model,
its tokenizer and what the engine needs."""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from transformers import PreTrainedTokenizerBase

from ..errors import ModelLoadError
from ..platform import mlx_device
from . import gguf
from .default import HOSTED, default_model_path, ensure_model
from .gguf_tokenizer import tokenizer_from_gguf

DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: Path
    context_length: int
    eos_token_ids: frozenset[int]
    dtype: str
    split: tuple[int, ...] = ()  # layers per rank, rank 0 first, when pipelined over processes
    ranks: int = 1  # processes that run it
    parallel: str = ""  # how it is split over them: "tensor" or "pipeline" ("" in one)
    comm_s: float = 0.0  # seconds a one-token forward spends in transfers (a probe at start)

    @property
    def placement(self) -> dict:
        """How it runs across processes, in the stats' field names (GenerationStats)."""
        return {"ranks": self.ranks, "split": list(self.split), "parallel": self.parallel,
                "comm_s": self.comm_s}

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)


def resolve_dtype(dtype: str) -> str:
    """The dtype policy: on the CPU dequantize to float32 (MLX's quantized matmul is slow and
    single-threaded there, and does not batch); on a GPU keep weights as stored."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"--dtype must be one of {', '.join(DTYPES)} (got '{dtype}')")
    if dtype == "auto":
        return "float32" if mlx_device() == "cpu" else "quantized"
    return dtype


def load(spec: str | None = None, dtype: str = "auto", quiet: bool = False) -> LoadedModel:
    """Load a target or draft model. `spec`: None, a hosted model's name ("default",
    "gemma3-270m": fetched on first use), a path, or a hub id."""
    dtype = resolve_dtype(dtype)
    if spec in (None, ""):
        spec = "default"
    if spec in HOSTED:
        return _load_gguf(ensure_model(HOSTED[spec], quiet), dtype, name=spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            # The cached default model, named by its path, is still the default (its shipped
            # draft and exit head apply).
            is_default = path.resolve() == default_model_path().resolve()
            return _load_gguf(path, dtype, name="default" if is_default else spec)
        raise ModelLoadError(f"{spec}: not a GGUF file or a model directory")
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_mlx_lm(str(path), dtype, name=spec)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, name=spec)
        raise ModelLoadError(f"{spec}: a model directory needs config.json or a single .gguf file")
    if _HUB_ID.match(spec) and not spec.startswith((".", "~")) and path.suffix != ".gguf":
        return _load_mlx_lm(spec, dtype, name=spec)
    raise ModelLoadError(f"{spec}: no such file or directory")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == gguf.MAGIC


def _load_gguf(path: Path, dtype: str, name: str) -> LoadedModel:
    header = gguf.read_header(path)
    try:
        config = gguf.model_config(header)
        tokenizer = tokenizer_from_gguf(header)
    except (TypeError, ValueError, KeyError, IndexError) as e:
        # Values of the wrong type or range in a header that is otherwise well formed.
        raise ModelLoadError(f"{path}: malformed metadata ({type(e).__name__}: {e})") from e
    try:
        weights = gguf.to_mlx_lm(header, config, gguf.load_tensors(header))
        arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        model = arch.Model(arch.ModelArgs.from_dict(config))
        # Drops the output projection where the file ties it to the embedding.
        weights = model.sanitize(weights)
        _quantize_like(model, weights)
        model.load_weights(list(weights.items()), strict=True)
    except (ValueError, RuntimeError, OverflowError, ArithmeticError, KeyError) as e:
        # Tensors whose shapes or types the metadata did not foretell (its sizes are checked
        # against the tensor table, not every tensor against every size).
        raise ModelLoadError(
            f"{path}: tensors do not match the {header.architecture} layout ({e})"
        ) from e
    eos = {tokenizer.eos_token_id} | {
        header.metadata[k] for k in ("tokenizer.ggml.eot_token_id",) if k in header.metadata
    }
    return _finish(model, tokenizer, name, path, config["max_position_embeddings"], eos, dtype)


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Turn the modules whose GGUF tensors are quantized into MLX quantized modules with the
    file's bits (Q4_x: 4, Q8_0: 8; groups of 32 in both)."""

    def predicate(path: str, module: nn.Module) -> Any:
        scales = weights.get(f"{path}.scales")
        if scales is None:
            return False
        bits = weights[f"{path}.weight"].shape[-1] // scales.shape[-1]
        return {"group_size": 32, "bits": bits}

    nn.quantize(model, class_predicate=predicate)


def _load_mlx_lm(spec: str, dtype: str, name: str) -> LoadedModel:
    from mlx_lm.utils import load as mlx_lm_load

    if Path(spec).is_dir():
        _check_layer_count(Path(spec))
    try:
        model, wrapper, config = mlx_lm_load(spec, return_config=True)
    except Exception as e:  # mlx-lm and the hub raise many types; all mean "cannot load this"
        where = "from the Hugging Face Hub" if not Path(spec).exists() else ""
        raise ModelLoadError(f"{spec}: cannot load {where}({type(e).__name__}: {e})") from e
    path = Path(spec) if Path(spec).exists() else Path(getattr(wrapper, "name_or_path", spec))
    _check_numbers(config, spec)
    if config.get("model_type") == "gemma3":
        # Gemma 3 4B and up: mlx-lm runs the text model inside, and so do we (it can split).
        model = model.language_model
        config = {**config, **config.get("text_config", {})}
    context = int(
        config.get("max_position_embeddings")
        or getattr(wrapper._tokenizer, "model_max_length", 4096)
    )
    eos = set(wrapper.eos_token_ids)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    ids = wrapper._tokenizer.get_vocab().values()
    if isinstance(vocab, int) and ids and max(ids) >= vocab:
        raise ModelLoadError(f"{spec}: the tokenizer has token ids up to {max(ids)}, the "
                             f"model's vocabulary is {vocab} tokens")
    return _finish(model, wrapper._tokenizer, name, path, context, eos, dtype)


def _check_layer_count(folder: Path) -> None:
    """A config.json whose layer count exceeds the layers in the weights: mlx-lm would build
    every layer before finding out (10^9 layers: for ever). The weights' names are read from
    the safetensors headers only."""
    try:
        config = json.loads((folder / "config.json").read_text())
        layers = config.get("num_hidden_layers", config.get("text_config", {}).get(
            "num_hidden_layers"))
    except (OSError, ValueError, AttributeError):
        return  # mlx-lm reports the unreadable config itself
    if type(layers) is not int:
        if layers is not None:
            raise ModelLoadError(f"{folder}: config.json's num_hidden_layers is {layers!r}")
        return
    found = set()
    for f in folder.glob("*.safetensors"):
        try:
            with open(f, "rb") as stream:
                size = int.from_bytes(stream.read(8), "little")
                names = json.loads(stream.read(min(size, 1 << 26)))
        except (OSError, ValueError):
            continue  # mlx-lm reports the unreadable file itself
        found |= {m.group(1) for n in names if (m := _LAYER.search(n))}
    if found and not 0 < layers <= len(found):
        raise ModelLoadError(f"{folder}: config.json says {layers} layers, the weights hold "
                             f"{len(found)}")


_LAYER = re.compile(r"layers\.(\d+)\.")


def _check_numbers(config: dict, spec: str) -> None:
    """The config's numbers that mlx-lm passes on unchecked, to fail (or compute NaN) at the
    first forward instead."""
    for key in ("rms_norm_eps", "rope_theta"):
        v = config.get(key, 1.0)
        if type(v) not in (int, float) or not 0 < v < float("inf"):
            raise ModelLoadError(f"{spec}: config.json's {key} is {v!r}, not a positive number")


def _finish(model, tokenizer, name, path, context, eos, dtype) -> LoadedModel:
    if context < 1:
        raise ModelLoadError(f"{path}: context length {context} is not positive")
    # Checked as stored: quantized weights are integers, so only their scales and biases are
    # read (a third of the cost of reading the dequantized floats), and dequantizing finite
    # values gives finite values.
    check_weights(tree_flatten(model.parameters()), str(path), quantized_paths(model))
    if dtype != "quantized":
        dequantize(model, getattr(mx, dtype))
    model.eval()
    mx.eval(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=Path(path),
        context_length=int(context),
        eos_token_ids=frozenset(int(e) for e in eos if e is not None),
        dtype=_describe_dtype(model),
    )


def materialize(module: nn.Module) -> None:
    """Evaluate every array `module` holds: its parameters and the rest, such as the RoPE
    frequency tables some families (llama3 and longrope scaling) compute when built. A lazy
    array belongs to the stream of the thread that made it, and MLX cannot evaluate it on
    another thread: the engine generates, and an MLX draft computes, on threads of their own."""
    mx.eval([a for _, a in tree_flatten(module) if isinstance(a, mx.array)])


def quantized_paths(model: nn.Module) -> frozenset[str]:
    """The modules whose `weight` holds packed integers."""
    return frozenset(p for p, m in model.named_modules() if hasattr(m, "bits"))


def check_weights(weights, where: str, quantized: frozenset[str] = frozenset()) -> None:
    """Refuse weights no trained model has: NaN or infinite values (a damaged file; every
    reply would be garbage or empty) and integers where floats belong (bytes read as another
    dtype). `weights`: (name, array) pairs; `quantized`: module paths whose `.weight` packs
    integers. One reduction per array, evaluated together."""
    floats = []
    for name, w in weights:
        if mx.issubdtype(w.dtype, mx.floating):
            floats.append((name, w))
        elif not (name.endswith(".weight") and name.removesuffix(".weight") in quantized):
            raise ModelLoadError(f"{where}: tensor '{name}' is {w.dtype}, not a float type")
    if not floats:
        return
    finite = mx.stack([mx.isfinite(w).all() for _, w in floats])
    mx.eval(finite)
    if not finite.all().item():
        first = floats[finite.tolist().index(False)][0]
        raise ModelLoadError(f"{where}: weights hold NaN or infinite values (first in "
                             f"'{first}'): the file is damaged")


def dequantize(model: nn.Module, dtype: mx.Dtype) -> None:
    """Replace quantized modules by dense ones in `dtype` and cast every float parameter.
    Scales and biases are widened first, so float32 dequantization is exact."""
    dense = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        w = mx.dequantize(
            module.weight,
            module.scales.astype(dtype),
            module.biases.astype(dtype) if module.biases is not None else None,
            group_size=module.group_size,
            bits=module.bits,
            mode=module.mode,
        ).astype(dtype)
        if isinstance(module, nn.QuantizedEmbedding):
            new = nn.Embedding(*w.shape)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
            if "bias" in module:
                new.bias = module.bias
        new.weight = w
        dense.append((path, new))
    if dense:
        model.update_modules(tree_unflatten(dense))
    model.update(
        tree_unflatten(
            [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
             if mx.issubdtype(v.dtype, mx.floating)]
        )
    )


def _describe_dtype(model: nn.Module) -> str:
    bits = {m.bits for _, m in model.named_modules() if hasattr(m, "bits")}
    floats = {
        str(v.dtype).removeprefix("mlx.core.")
        for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    }
    if bits:
        widths = "/".join(f"{b}-bit" for b in sorted(bits))
        return f"quantized ({widths}, {'/'.join(sorted(floats))})"
    return "/".join(sorted(floats))

