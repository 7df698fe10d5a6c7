"""Shared fixtures: the real default model, loaded once per test session."""

import mirror_mlx  # noqa: F401  (first: makes MLX use OpenBLAS where installed)
from mirror_mlx.models.default import ensure_default_model
from mirror_mlx.models.load import load

import pytest


@pytest.fixture(scope="session")
def default_gguf():
    return ensure_default_model(quiet=True)


@pytest.fixture(scope="session")
def target(default_gguf):
    """The default target, dequantized to float32 (the CPU policy)."""
    return load(str(default_gguf), dtype="float32")
