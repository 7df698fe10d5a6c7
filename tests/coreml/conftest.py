"""A small draft of the kind `mirror-mlx distill` writes (narrower than the target, with an
input projection and a restricted head larger than one Neural Engine chunk), and ONE package
exported from it through the CLI, shared by every Core ML test."""

from mirror_mlx.cli import main
from mirror_mlx.draft.coreml_package import PackageSpec
from mirror_mlx.draft.load import load_draft, target_info
from mirror_mlx.draft.net import DraftConfig, DraftNet

import mlx.core as mx
import numpy as np
import pytest

CONTEXT = 256
MAX_BRANCH_TOKENS = 8


@pytest.fixture(scope="session")
def small_draft_folder(target, tmp_path_factory):
    mx.random.seed(0)
    head = np.sort(np.random.default_rng(0).choice(target.vocab_size, 20000, replace=False))
    config = DraftConfig(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=target.vocab_size,
                         embed_size=576, rope_theta=100000.0, head_tokens=head.tolist(),
                         target=target_info(target))
    net = DraftNet(config)
    net.embed_tokens = target.model.model.embed_tokens
    folder = tmp_path_factory.mktemp("drafts") / "small"
    net.save(folder)
    return folder


@pytest.fixture(scope="session")
def small_draft(target, small_draft_folder):
    return load_draft(str(small_draft_folder), target)


@pytest.fixture(scope="session")
def package(small_draft_folder):
    """The small draft exported as draft.mlpackage inside its folder (where the backend looks
    for it), through `mirror-mlx export-draft`."""
    out = small_draft_folder / "draft.mlpackage"
    assert main(["export-draft", "--draft", str(small_draft_folder), "--out", str(out),
                 "--context", str(CONTEXT), "--max-branch-tokens", str(MAX_BRANCH_TOKENS)]) == 0
    return out


@pytest.fixture(scope="session")
def package_spec(package):
    from mirror_mlx.draft.coreml_draft import read_package_spec

    spec = read_package_spec(package)
    assert isinstance(spec, PackageSpec)
    return spec
