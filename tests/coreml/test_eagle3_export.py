"""EAGLE-3 heads (draft/eagle3.py) exported to Core ML: the package's module, through the
reference executor, against the MLX drafter's head on test_parity's feature calls, for the
published layouts' options (tiny heads written by tests/draft/test_eagle3.py, head_dim 32)."""

from pathlib import Path

from mirror_mlx.draft.coreml_draft import CoreMLExecutor, mlx_embedding
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.mlx_draft import MLXExecutor
from mirror_mlx.models.load import LoadedModel

import pytest
import torch

from coreml_export.convert import package_spec
from coreml_export.reference import ReferenceModel
from tests.coreml.test_families_parity import within
from tests.coreml.test_parity import feature_scenario
from tests.draft import test_eagle3
from tests.families.tiny import tiny

HEADS = {
    "eagle": (dict(layout="eagle"), "none"),
    "specforge-fc-norm": (dict(layout="eagle", fc_norm=True), "layers"),
    "specforge-raw": (dict(layout="eagle", raw_head=True), "none"),
    "speculators": (dict(layout="speculators", norm_before_residual=True, norm_output=True,
                         layers=2), "none"),
    "speculators-norm-before-fc": (dict(layout="speculators", norm_before_fc=True), "whole"),
    "speculators-qwen3": (dict(layout="speculators", kind="qwen3", bias=True, fc_norm=True),
                          "layers"),
}


@pytest.fixture(scope="module")
def small(target):
    return LoadedModel(model=tiny("llama", layers=test_eagle3.LAYERS), tokenizer=target.tokenizer,
                       name="tiny", path=Path("tiny"), context_length=256,
                       eos_token_ids=frozenset(), dtype="float32")


@pytest.mark.parametrize("name", HEADS)
def test_eagle3_head_matches_mlx(name, small, tmp_path, monkeypatch):
    monkeypatch.setattr(test_eagle3, "HEAD_DIM", 32)  # the Neural Engine's states need 32
    variant, feature_norm = HEADS[name]
    test_eagle3.write_head(tmp_path / "head", variant)
    net = load_draft(str(tmp_path / "head"), small)
    spec, weights = package_spec(net, 256, 8)
    assert spec.form.eagle3 and spec.form.feature_norm == feature_norm
    for state, relative in ((torch.float32, 1e-4), (torch.float16, 5e-2)):
        reference = ReferenceModel(spec, weights, state_dtype=state)
        ref = CoreMLExecutor(reference, spec, mlx_embedding(net.embed_tokens))
        feature_scenario(net, MLXExecutor(net), ref, small, within(relative), relative)
