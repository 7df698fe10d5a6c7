"""A draft -> a Core ML mlprogram package for the Neural Engine: fp16, macOS 15 (stateful
models), the KV cache as state, enumerated query lengths, optional weight compression, and the
metadata the backend reads (draft/coreml_package.py)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from mirror_mlx.draft.coreml_draft import import_coremltools
from mirror_mlx.draft.coreml_package import (
    PackageSpec,
    draft_weights,
    form_of,
    query_sizes,
    source_sha256,
    weights_sha256,
)
from mirror_mlx.draft.net import DraftNet
from mirror_mlx.errors import InvalidParameter
from mirror_mlx.progress import Progress

import numpy as np
import torch

from .ane_model import ANEDraft

# none | int8 (per-channel linear) | palettize4/6/8 (per-tensor k-means look-up tables).
COMPRESSIONS = ("none", "int8", "palettize4", "palettize6", "palettize8")
# Per-tensor k-means runs on kmeans1d, which coremltools uses only for tensors of 10k weights
# or more (smaller ones would need scikit-learn); smaller tensors stay fp16.
PALETTIZE_MIN_WEIGHTS = 10_000
STAGES = 5  # progress: weights, trace, convert, compress, save
# Every draft package is stateful (its KV cache). coremltools #2716 (open): a 4-bit palettized
# stateful package built with coremltools 9.0 crashed (segfault in predict) on the Neural
# Engine after ~100-200 predictions, and the same source built with 8.3 did not; the cause is
# not known, so 6 and 8 bits, built the same way, are not known to be safe either. Until a Mac
# shows otherwise: palettize4 is refused without an explicit opt-in, 6 and 8 bits warn.
PALETTE_RISK = ("palettized stateful packages built with coremltools 9.0 crashed on the Neural "
                "Engine after ~100-200 predictions (coremltools #2716, reported for 4-bit "
                "palettes; 6 and 8 bits are built the same way and not known to be safe)")


def package_spec(net: DraftNet, context: int, max_branch_tokens: int, source: str = "",
                 compress: str = "none") -> tuple[PackageSpec, dict[str, np.ndarray]]:
    """The contract a package of `net` will have, and the weights it will hold."""
    if compress not in COMPRESSIONS:
        raise InvalidParameter(f"--compress must be one of {', '.join(COMPRESSIONS)}")
    form = form_of(net)
    weights = draft_weights(net)
    path = Path(source).expanduser()
    spec = PackageSpec(net.config, context, query_sizes(max_branch_tokens),
                       weights_sha256(weights), source,
                       source_sha256(path) if source and path.exists() else "", compress,
                       form=form)
    spec.check()
    return spec, weights


def convert(spec: PackageSpec, weights: dict[str, np.ndarray], out: str | Path,
            quiet: bool = False):
    """Convert and save; returns the coremltools MLModel."""
    ct = import_coremltools()

    out = Path(out)
    if out.suffix != ".mlpackage":
        raise InvalidParameter(f"{out}: the output must end in .mlpackage")
    progress = Progress(f"export {out.name}", STAGES, "stages", quiet)
    module = ANEDraft(spec, weights)
    progress.advance(1, "tracing")
    s_max = max(spec.query_sizes)
    example = tuple(torch.from_numpy(np.zeros(spec.input_shape(n, s_max), spec.input_dtype(n)))
                    for n in spec.inputs)
    with torch.no_grad(), warnings.catch_warnings():
        # torch 2.13 deprecates jit.trace; coremltools' tested path for states is TorchScript.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        traced = torch.jit.trace(module, example)
    progress.advance(1, "converting")

    def enumerated(name: str):
        if name == "write_pos":
            return ct.TensorType(name, shape=(1,), dtype=np.int32)
        shapes = [spec.input_shape(name, s) for s in spec.query_sizes]
        return ct.TensorType(name, shape=ct.EnumeratedShapes(shapes, default=shapes[0]),
                             dtype=np.float32)

    model = ct.convert(
        traced,
        convert_to="mlprogram",
        inputs=[enumerated(n) for n in spec.inputs],
        outputs=[ct.TensorType(n, dtype=np.float16) for n in spec.outputs],
        states=[ct.StateType(wrapped_type=ct.TensorType(shape=spec.state_shape(n),
                                                        dtype=np.float16), name=n)
                for n in ("k_cache", "v_cache")],
        minimum_deployment_target=ct.target.macOS15,
        compute_precision=ct.precision.FLOAT16,
        compute_units=ct.ComputeUnit[spec.compute_units],
        skip_model_load=True,  # exporting needs no prediction (and on macOS would compile)
    )
    progress.advance(1, "compressing" if spec.compress != "none" else "converted")
    model = compress(model, spec.compress)
    progress.advance(1, "saving")
    model.user_defined_metadata.update(spec.to_metadata())
    model.short_description = (
        f"mirror-mlx draft for the Neural Engine: {spec.config.num_layers} layers, width "
        f"{spec.config.hidden_size}, {spec.config.head_size}-token head, context {spec.context}")
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    progress.advance(1, "saved")
    progress.close()
    return model


def compress(model, how: str):
    """Weight compression, after conversion (coremltools' post-training API)."""
    if how == "none":
        return model
    cto = import_coremltools().optimize.coreml

    if how == "int8":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8",
                                          granularity="per_channel")
        return cto.linear_quantize_weights(model, cto.OptimizationConfig(global_config=op))
    op = cto.OpPalettizerConfig(mode="kmeans", nbits=int(how.removeprefix("palettize")),
                                granularity="per_tensor",
                                weight_threshold=PALETTIZE_MIN_WEIGHTS)
    return cto.palettize_weights(model, cto.OptimizationConfig(global_config=op))


def check_palette(compress: str, allow_palettized_state: bool, warn: bool = True) -> None:
    """Refuse palettize4 without the opt-in, and warn on any palette (PALETTE_RISK)."""
    if not compress.startswith("palettize"):
        return
    if compress == "palettize4" and not allow_palettized_state:
        raise InvalidParameter(f"--compress palettize4: {PALETTE_RISK}; use int8 (6 and 8 bits "
                               "export with a warning), or pass --allow-palettized-state to "
                               "export it anyway")
    if warn:
        warnings.warn(f"--compress {compress}: {PALETTE_RISK}; int8 is the safe choice until a "
                      "Mac shows otherwise", stacklevel=3)


def export_draft(net: DraftNet, out: str | Path, *, source: str = "", context: int = 2048,
                 max_branch_tokens: int = 32, compress: str = "none", quiet: bool = False,
                 allow_palettized_state: bool = False):
    """`mirror-mlx export-draft`: returns the package's PackageSpec."""
    check_palette(compress, allow_palettized_state)
    spec, weights = package_spec(net, context, max_branch_tokens, source, compress)
    convert(spec, weights, out, quiet)
    return spec


def export_command(model: str | None, draft: str | None, out: str, *, context: int,
                   max_branch_tokens: int, compress: str,
                   allow_palettized_state: bool = False) -> list[str]:
    """Load the target and its draft, export the draft, and describe the package."""
    if not out.endswith(".mlpackage"):
        raise InvalidParameter(f"{out}: the output must end in .mlpackage")
    check_palette(compress, allow_palettized_state, warn=False)  # before loading anything
    from mirror_mlx.draft.load import load_draft
    from mirror_mlx.models.load import load

    from .inspect import inspect_command

    target = load(model)
    net = load_draft(draft, target)
    source = draft or "default"
    if Path(source).expanduser().exists():  # the backend may load it from elsewhere
        source = str(Path(source).expanduser().resolve())
    export_draft(net, out, source=source, context=context, max_branch_tokens=max_branch_tokens,
                 compress=compress, allow_palettized_state=allow_palettized_state)
    return inspect_command(out)
