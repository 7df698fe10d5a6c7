"""The GGUF loader against independent references, on the real default model."""

from mirror_mlx.api import Engine
from mirror_mlx.models.gguf import read_header
from mirror_mlx.models.gguf_tokenizer import tokenizer_from_gguf

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

TEXT = (
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. At 330 metres it "
    "was the tallest structure in the world for 41 years. Engineers doubted it would stand; "
    "today it draws about seven million visitors a year.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nQ: What is 17 * 23?\nA: 17 * 23 = 391.\n"
    "Naïve café owners in Zürich serve crème brûlée; 東京 and 😀 need several bytes each."
)

VARIED = [
    TEXT,
    "  leading spaces, trailing spaces   ",
    "numbers 1234567890 3.14159 -42 1e-5 2026-12-02",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's what we'd've done. DON'T SHOUT",
    "tabs\tand\nnew\n\nlines\r\nand unicode: ñ ü ß Ω ∑ 🤖",
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


def test_logits_match_transformers_gguf_loader(target, hf_model, hf_tokenizer):
    import torch

    ids = hf_tokenizer.encode(TEXT)
    assert len(ids) > 100
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    ours = np.array(target.model(mx.array(ids)[None])[0].astype(mx.float32))
    assert ours.shape == ref.shape
    agree = (ours.argmax(-1) == ref.argmax(-1)).mean()
    delta = np.abs(ours - ref).max()
    assert agree == 1.0, f"top-1 agreement {agree:.4f}"
    assert delta < 2e-3, f"max |dlogit| {delta}"


def test_tokenizer_matches_transformers(default_gguf, hf_tokenizer):
    ours = tokenizer_from_gguf(read_header(default_gguf))
    for text in VARIED:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids) == text


def test_chat_template_renders_as_transformers(default_gguf, hf_tokenizer):
    ours = tokenizer_from_gguf(read_header(default_gguf))
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."},
         {"role": "user", "content": "Another, in French: é?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            a = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            b = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=gen)
            assert a == b
            assert ours.encode(a, add_special_tokens=False) == \
                hf_tokenizer.encode(b, add_special_tokens=False)


@pytest.mark.parametrize("prompt", [
    "Write a haiku about the sea.",
    "def add(a, b):",
    "List three prime numbers greater than 100.",
])
def test_greedy_ids_equal_mlx_lm_generation(target, prompt):
    engine = Engine(target, mode="ar")
    ids = engine.encode(prompt)
    ours = engine.generate(ids, max_tokens=24).token_ids
    theirs = []
    for token, _ in generate_step(mx.array(ids), target.model, max_tokens=24):
        if token in target.eos_token_ids:
            break
        theirs.append(token)
    assert ours == theirs
