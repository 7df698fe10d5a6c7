"""The GGUF tensor mapping, checked on a tiny model written in llama.cpp's layout."""

from mirror_mlx.models.load import load

import mlx.core as mx
import numpy as np

from tests.helpers import assert_same_logits, write_tiny_gguf


def test_tiny_gguf_logits_equal_the_model_it_holds(tmp_path, default_gguf):
    path = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(path, default_gguf, seed=3)
    loaded = load(str(path), dtype="float32")
    ids = mx.array([[1, 504, 3327, 28, 253, 1234, 42, 7]])
    a = np.array(original(ids))
    b = np.array(loaded.model(ids))
    assert_same_logits(b, a)
    assert loaded.context_length == 256
    assert loaded.eos_token_ids == {2}
