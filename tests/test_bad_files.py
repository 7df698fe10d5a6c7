"""Broken files that benchmarks/fuzz_files.py found getting past the loaders: each is refused
with a ModelLoadError at load, not at the first forward (a traceback) or never (a model that
decodes garbage from NaN weights or metadata)."""

import json
import math
import struct

from mirror_mlx.cli import main
from mirror_mlx.draft.load import load_folder, target_info
from mirror_mlx.draft.net import DraftNet
from mirror_mlx.errors import ModelLoadError
from mirror_mlx.models.gguf import read_header
from mirror_mlx.models.load import load
from mirror_mlx.models.split import ExitHead

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tests.families import tiny as families
from tests.helpers import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, default_gguf):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, default_gguf)
    return path


@pytest.fixture(scope="module")
def tiny_target(tiny_gguf):
    return load(str(tiny_gguf), dtype="float32")


def _patched_value(data: bytes, key: str, fmt: str, value) -> bytes:
    """The file with metadata `key`'s value (of struct format `fmt`) replaced."""
    raw = key.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw) + 4
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


@pytest.mark.parametrize("key, fmt, value", [
    ("llama.attention.head_count", "<I", 0),  # was a ZeroDivisionError traceback
    ("llama.attention.layer_norm_rms_epsilon", "<f", math.nan),  # was silent garbage
    ("llama.rope.freq_base", "<f", -5.0),  # was silent garbage
    ("llama.attention.head_count_kv", "<I", 3),  # was a reshape error at the first forward
])
def test_gguf_metadata_a_model_cannot_run_with(tmp_path, tiny_gguf, key, fmt, value):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_patched_value(tiny_gguf.read_bytes(), key, fmt, value))
    with pytest.raises(ModelLoadError, match="metadata"):
        load(str(path))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_gguf_non_finite_weights(tmp_path, tiny_gguf, bad):
    data = bytearray(tiny_gguf.read_bytes())
    header = read_header(tiny_gguf)
    info = header.tensors["blk.1.ffn_down.weight"]
    assert info.type_name == "F32"
    at = header.data_start + info.offset + 4 * 77
    data[at:at + 4] = struct.pack("<f", bad)
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="NaN or infinite.*layers.1.mlp.down_proj"):
        load(str(path))


@pytest.fixture(scope="module")
def mlx_lm_folder(tmp_path_factory, tiny_target):
    model = families.tiny("llama", layers=2)
    return families.save(model, "llama", tmp_path_factory.mktemp("mlx-lm") / "m",
                         tiny_target.tokenizer)


def _copy_folder(src, dest):
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_mlx_lm_nan_weight(tmp_path, mlx_lm_folder):
    folder = _copy_folder(mlx_lm_folder, tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    w = np.array(weights["model.layers.0.mlp.up_proj.weight"])
    w[3, 5] = np.nan
    weights["model.layers.0.mlp.up_proj.weight"] = mx.array(w)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match="NaN or infinite.*up_proj"):
        load(str(folder))


def test_multi_line_library_error_prints_as_one_line(tmp_path, mlx_lm_folder, capsys):
    """mlx-lm's message for missing weights spans lines; the CLI's error stays one line."""
    folder = _copy_folder(mlx_lm_folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert main(["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "1"]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mirror-mlx: error:"), lines


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory, tiny_target):
    folder = tmp_path_factory.mktemp("draft") / "d"
    DraftNet.from_model(tiny_target.model, 1, target_info(tiny_target)).save(folder)
    return folder


def _edited_draft(tmp_path, draft_folder, config=None, weights=None):
    folder = _copy_folder(draft_folder, tmp_path / "d")
    if config:
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, **config}))
    if weights:
        tensors = mx.load(str(folder / "weights.safetensors"))
        mx.save_safetensors(str(folder / "weights.safetensors"), weights(tensors))
    return folder


def test_draft_folder_loads(tmp_path, draft_folder, tiny_target):
    assert load_folder(_edited_draft(tmp_path, draft_folder), tiny_target).config.num_layers == 1


def _poke(name, value):
    def edit(tensors):
        w = np.array(tensors[name])
        w.flat[7] = value
        return {**tensors, name: mx.array(w)}
    return edit


def _as_int(name):
    return lambda tensors: {**tensors, name: tensors[name].astype(mx.int32)}


Q = "layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("config, weights, needle", [
    ({"num_kv_heads": 3}, None, "heads"),  # was a reshape traceback at the first forward
    ({"num_kv_heads": 1, "num_heads": 2}, None, "do not match"),  # the same, at the shapes
    ({"head_tokens": [-1]}, None, "head_tokens"),  # was an IndexError traceback
    ({"quantization": "yes"}, None, "quantization"),  # was a TypeError traceback
    ({"num_layers": 2}, None, "num_layers"),
    (None, _poke(Q, np.nan), "NaN"),  # was silent
    (None, _poke("norm.weight", -np.inf), "NaN"),
    (None, _as_int(Q), "not a float"),  # was silent: integers read as weights
])
def test_broken_draft_folders(tmp_path, draft_folder, tiny_target, config, weights, needle):
    folder = _edited_draft(tmp_path, draft_folder, config, weights)
    with pytest.raises(ModelLoadError, match=needle):
        load_folder(folder, tiny_target)


@pytest.mark.parametrize("weight, bias, needle", [
    (np.full((64, 64), np.nan, np.float32), np.zeros(64, np.float32), "NaN"),
    (np.zeros((64, 64), np.float32), np.array([np.inf] + [0] * 63, np.float32), "NaN"),
    (np.ones((64, 64), np.int32), np.zeros(64, np.float32), "not a float"),
])
def test_broken_exit_heads(tmp_path, weight, bias, needle):
    path = tmp_path / "exit.safetensors"
    mx.save_safetensors(str(path), {"weight": mx.array(weight), "bias": mx.array(bias)},
                        metadata={"layer": "1", "format": "mirror-mlx-exit"})
    with pytest.raises(ModelLoadError, match=needle):
        ExitHead.load(path, 64, 2)
    ExitHead(1, 64).save(path)
    assert not any(mx.isnan(v).any().item() for _, v in
                   tree_flatten(ExitHead.load(path, 64, 2).parameters()))


def test_core_ml_package_with_an_empty_model_file(tmp_path):
    pytest.importorskip("coremltools")
    from mirror_mlx.draft.coreml_draft import load_package

    package = tmp_path / "d.mlpackage"
    (package / "Data/com.apple.CoreML").mkdir(parents=True)
    (package / "Data/com.apple.CoreML/model.mlmodel").write_bytes(b"")
    (package / "Manifest.json").write_text(json.dumps({
        "fileFormatVersion": "1.0.0", "rootModelIdentifier": "m",
        "itemInfoEntries": {"m": {"author": "com.apple.CoreML", "name": "model.mlmodel",
                                  "description": "CoreML Model Specification",
                                  "path": "com.apple.CoreML/model.mlmodel"}}}))
    with pytest.raises(ModelLoadError, match="holds no model"):
        load_package(package)


def test_gguf_tensor_type_that_misstates_its_size(tmp_path, tiny_gguf):
    """F32 bytes declared F16 fit in the file; they were read as garbage weights."""
    data = tiny_gguf.read_bytes()
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack("<I", data[at:at + 4])[0]
    at += 4 + 8 * n_dims
    assert struct.unpack("<I", data[at:at + 4])[0] == 0  # F32
    path = tmp_path / "lie.gguf"
    path.write_bytes(data[:at] + struct.pack("<I", 1) + data[at + 4:])
    with pytest.raises(ModelLoadError, match="token_embd.weight"):
        load(str(path))


def test_draft_config_that_is_not_an_object(tmp_path, draft_folder, tiny_target):
    folder = _copy_folder(draft_folder, tmp_path / "d")
    (folder / "config.json").write_text("[]")
    assert not DraftNet.is_draft_folder(folder)  # was an AttributeError traceback
