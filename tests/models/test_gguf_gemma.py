"""Gemma 3 through the GGUF loader, on a tiny random model written with the `gguf` package in
llama.cpp's layout: transformers' own GGUF loader is the reference; AR and SD agree on it; a
damaged file fails cleanly. Offline: nothing here needs the real Gemma file."""

from pathlib import Path

from mirror_mlx.api import Engine
from mirror_mlx.errors import InvalidParameter, ModelLoadError
from mirror_mlx.models.load import load
from mirror_mlx.train.distill import init_draft

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers import GEMMA_TOKENS, TINY_GEMMA, assert_same_logits, write_tiny_gemma_gguf

# Longer than the sliding window (4): the local layers must forget, the global one must not.
IDS = [2, 270, 271, 5, 9, 272, 273, 274, 275, 276, 277, 100, 261, 262, 263]


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf"
    write_tiny_gemma_gguf(path, seed=5)
    return path


@pytest.fixture(scope="module")
def gemma(gemma_file, tmp_path_factory):
    # The SentencePiece tokenizer is cached by vocabulary: keep the test's out of the user's.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MIRROR_MLX_CACHE", str(tmp_path_factory.mktemp("cache")))
        return load(str(gemma_file), dtype="float32")


def test_logits_match_transformers_gguf_loader(gemma_file, gemma):
    import torch
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(
        gemma_file.parent, gguf_file=gemma_file.name, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0].numpy()
    ours = np.array(gemma.model(mx.array([IDS]))[0])
    assert gemma.model.model_type == "gemma3_text"
    assert_same_logits(ours, ref)  # 4e-6 apart here, logits up to 3.9


def test_config_and_tokenizer(gemma):
    args = gemma.model.args
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "sliding_window",
                "sliding_window_pattern", "query_pre_attn_scalar"):
        assert getattr(args, key) == TINY_GEMMA[key], key
    assert args.vocab_size == len(GEMMA_TOKENS)
    assert gemma.eos_token_ids == {1}
    assert gemma.tokenizer.chat_template is None  # a base model: completion only
    text = "the cat on the mat\nzebra! 😀"
    ids = gemma.tokenizer.encode(text)
    assert ids[0] == 2  # <bos>
    assert gemma.tokenizer.decode(ids, skip_special_tokens=True) == text


def test_ar_and_sd_agree_past_the_window(gemma, tmp_path):
    """Greedy SD with a draft trained for nothing is still the target's own greedy text, and
    both read the sliding window right while the cache is trimmed after rejections."""
    draft = init_draft(gemma, 1, list(range(256, len(GEMMA_TOKENS))))
    draft.save(tmp_path / "draft")
    ar = Engine(gemma, mode="ar").generate(IDS, max_tokens=24)
    with Engine(gemma, mode="sd", draft=str(tmp_path / "draft"), gamma=3) as engine:
        sd = engine.generate(IDS, max_tokens=24)
    assert sd.token_ids == ar.token_ids and len(ar.token_ids) > 8
    assert sd.stats.draft_tokens > 0  # it ran as SD: the target verified drafts


def test_completion_model_has_no_chat(gemma):
    engine = Engine(gemma, mode="ar")
    assert engine.encode("the cat") == gemma.tokenizer.encode("the cat")
    with pytest.raises(InvalidParameter, match="no chat template"):
        engine.encode([{"role": "user", "content": "hi"}])
    # No shipped draft: the target's own first layers draft, and the GGUF target splits.
    ar = Engine(gemma, mode="ar").generate(IDS, max_tokens=16).token_ids
    with Engine(gemma, mode="mirror", exit_layer=4) as mirror:
        assert mirror.generate(IDS, max_tokens=16).token_ids == ar


def test_damaged_gemma_files(gemma_file, tmp_path):
    data = gemma_file.read_bytes()
    for cut in (40, 3000, len(data) // 2, len(data) - 7):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated|corrupt"):
            load(str(path))
    path = tmp_path / "bad-tokenizer.gguf"
    path.write_bytes(data.replace(b"tokenizer.ggml.model\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00"
                                  b"\x00\x00llama", b"tokenizer.ggml.model\x08\x00\x00\x00\x05"
                                  b"\x00\x00\x00\x00\x00\x00\x00bpe!!"))
    with pytest.raises(ModelLoadError, match="tokenizer type 'bpe!!' is not supported"):
        load(str(path))
