"""The exported package (one conversion, shared: conftest.py) has the contract the backend
relies on: inputs, enumerated shapes, fp16 states, outputs, metadata, ops; and the CLI around
export and inspection."""

import warnings
from collections import Counter
from dataclasses import replace

from mirror_mlx.cli import main
from mirror_mlx.draft.coreml_package import (
    FEATURE_INPUTS,
    INPUTS,
    META,
    PackageSpec,
    draft_weights,
    source_sha256,
    weights_sha256,
)
from mirror_mlx.draft.net import DraftNet
from mirror_mlx.errors import InvalidParameter, ModelLoadError
from mirror_mlx.platform import coreml_can_run

import coremltools as ct
import pytest

from coreml_export.convert import check_palette, compress, export_draft
from coreml_export.inspect import inspect_package
from coreml_export.reference import ReferenceModel
from tests.coreml.conftest import CONTEXT

SIZES = (1, 2, 4, 8)


def test_package_contract(package, small_draft):
    spec = ct.utils.load_spec(str(package))
    assert spec.WhichOneof("Type") == "mlProgram"
    assert spec.specificationVersion == 9  # Core ML 8: macOS 15 / iOS 18, stateful models
    assert spec.mlProgram.functions["main"].opset == "CoreML8"

    report = inspect_package(package)
    c = small_draft.config
    assert {name: (dtype, shapes) for name, dtype, shapes in report.inputs} == {
        "embeds": ("FLOAT32", [(1, 576, 1, s) for s in SIZES]),
        "rope_cos": ("FLOAT32", [(1, 32, 1, s) for s in SIZES]),
        "rope_sin": ("FLOAT32", [(1, 32, 1, s) for s in SIZES]),
        "mask": ("FLOAT32", [(1, CONTEXT, 1, s) for s in SIZES]),
        "write_pos": ("INT32", [(1,)]),
    }
    assert [name for name, _, _ in report.inputs] == list(INPUTS)
    kv = c.num_layers * c.num_kv_heads
    assert report.states == [("k_cache", "FLOAT16", (kv, CONTEXT, 1, 32)),
                             ("v_cache", "FLOAT16", (kv, CONTEXT, 1, 32))]
    # The 20000-token head is split in two chunks: no dimension above 16384.
    assert report.outputs == [("logits_0", "FLOAT16"), ("logits_1", "FLOAT16")]

    meta = {k.removeprefix("mirror_mlx."): v for k, v in report.metadata.items()}
    assert meta["compute_units"] == "CPU_AND_NE"  # Core ML does not store it: we do
    assert meta["vocab_size"] == "49152" and meta["head_size"] == "20000"
    assert meta["context"] == str(CONTEXT) and meta["query_sizes"] == "1,2,4,8"
    assert meta["weights_sha256"] == weights_sha256(draft_weights(small_draft))
    assert meta["source"] == str(package.parent.resolve()) and meta["compress"] == "none"
    assert meta["source_sha256"] == source_sha256(package.parent)

    # Per layer: q, k, v, o, gate, up, down; plus the input projection and two head chunks.
    ops = report.ops
    assert ops["conv"] == 7 * c.num_layers + 1 + 2
    per_head = c.num_heads * c.num_layers
    assert ops["einsum"] == ops["matmul"] == ops["softmax"] == per_head  # scores; sum of values
    assert ops["slice_update"] == ops["write_state"] == 2 * c.num_layers
    assert ops["transpose"] == 2 * c.num_layers  # the new keys and values, never a cache
    assert not {"scaled_dot_product_attention", "gather_nd", "scatter"} & set(ops)
    assert report.warnings == []


def test_reference_matches_package(package, small_draft, target):
    model = ReferenceModel.for_package(package, draft_weights(small_draft))
    assert model.spec.config == small_draft.config
    other = draft_weights(small_draft)
    other["norm.weight"] = other["norm.weight"] + 1
    with pytest.raises(ModelLoadError, match="not exported from these weights"):
        ReferenceModel.for_package(package, other)


def test_compression(package):
    """int8 and 6-bit palettes, applied to the converted program (on any OS)."""
    matrices = 7 * 2 + 1 + 2
    # Palettes: the two 64x128 value projections are below the 10k weights kmeans1d needs
    # (PALETTIZE_MIN_WEIGHTS) and stay fp16; int8 takes every matrix.
    for how, op, n in (("int8", "constexpr_blockwise_shift_scale", matrices),
                       ("palettize6", "constexpr_lut_to_dense", matrices - 2)):
        model = compress(ct.models.MLModel(str(package), skip_model_load=True), how)
        spec = model.get_spec()
        main_fn = spec.mlProgram.functions["main"]
        ops = Counter(o.type for o in main_fn.block_specializations[main_fn.opset].operations)
        assert ops[op] == n, ops
        assert len(spec.description.state) == 2


def test_cli_inspect(package, capsys):
    assert main(["inspect", str(package)]) == 0
    out = capsys.readouterr().out
    assert "k_cache    FLOAT16  4x256x1x32" in out
    assert "embeds     FLOAT32  1x576x1x1 | 1x576x1x2 | 1x576x1x4 | 1x576x1x8" in out
    assert "warnings: none" in out
    if not coreml_can_run():
        assert "placement: not checked (Core ML runs only on macOS" in out


def test_cli_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mirror-mlx: error: ") and "not a Core ML package" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["export-draft", "--draft", "self:1", "--out", str(tmp_path / "x.onnx")]) == 1
    assert "must end in .mlpackage" in capsys.readouterr().err


def test_palettes_of_stateful_packages_warn_or_need_an_opt_in(small_draft, tmp_path, capsys):
    """coremltools #2716: 4-bit palettized stateful packages crashed on the Neural Engine. Every
    draft package is stateful: export-draft refuses palettize4 (before loading anything)
    unless opted in, and warns on any palette."""
    assert main(["export-draft", "--draft", "self:1", "--out", str(tmp_path / "x.mlpackage"),
                 "--compress", "palettize4"]) == 1
    err = capsys.readouterr().err
    assert "#2716" in err and "--allow-palettized-state" in err
    with pytest.raises(InvalidParameter, match="#2716"):
        export_draft(small_draft, tmp_path / "x.mlpackage", compress="palettize4", quiet=True)
    assert not (tmp_path / "x.mlpackage").exists()
    for how, allowed in (("palettize4", True), ("palettize6", False), ("palettize8", False)):
        with pytest.warns(UserWarning, match="#2716"):
            check_palette(how, allowed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_palette("int8", False)
        check_palette("none", False)


def test_state_sizes_the_neural_engine_runs(small_draft, capsys):
    """States whose dimensions are not multiples of 32 fail on the Neural Engine (coremltools
    #2631): such a context or head_dim is refused before any conversion."""
    assert main(["export-draft", "--draft", "self:1", "--out", "x.mlpackage",
                 "--context", "100"]) == 1
    assert "context must be a multiple of 32" in capsys.readouterr().err
    spec = PackageSpec(replace(small_draft.config, head_dim=48), 256, (1, 2))
    with pytest.raises(ModelLoadError, match="head_dim 48 is not a multiple of 32"):
        spec.check()
    with pytest.raises(InvalidParameter, match="multiple of 32"):
        PackageSpec(small_draft.config, 250, (1, 2)).check()


def test_packages_of_another_layout_are_refused():
    with pytest.raises(ModelLoadError, match="another mirror-mlx version.*export it again"):
        PackageSpec.from_metadata({META + "format": "mirror-mlx-coreml-draft/1"})


def test_feature_draft_package_contract(target, small_draft, tmp_path):
    """A draft that reads the target's features exports with three more inputs (the target's
    hidden states, the host's own feature, which of the two) and two more outputs."""
    config = replace(small_draft.config, num_layers=1, feature_layers=[3, 15, 25],
                     feature_size=576, head_tokens=small_draft.config.head_tokens[:4096])
    net = DraftNet(config)
    net.embed_tokens = target.model.model.embed_tokens
    spec = export_draft(net, tmp_path / "f.mlpackage", context=64, max_branch_tokens=2,
                        quiet=True)
    report = inspect_package(tmp_path / "f.mlpackage")
    shapes = {name: (dtype, shape) for name, dtype, shape in report.inputs}
    assert [name for name, _, _ in report.inputs] == list(INPUTS + FEATURE_INPUTS)
    assert shapes["target_features"] == ("FLOAT32", [(1, 3 * 576, 1, s) for s in (1, 2)])
    assert shapes["own_features"] == ("FLOAT32", [(1, 128, 1, s) for s in (1, 2)])
    assert shapes["from_target"] == ("FLOAT32", [(1, 1, 1, s) for s in (1, 2)])
    assert report.outputs == [("logits_0", "FLOAT16"), ("top", "FLOAT16"), ("fed", "FLOAT16")]
    assert ReferenceModel.for_package(tmp_path / "f.mlpackage", draft_weights(net)).spec == spec
    assert report.warnings == []
