"""Speculative edge cases: stops inside an accepted window, limits reached mid-window, a draft
with another vocabulary, a draft that fails."""

import threading

from mirror_mlx.api import Engine
from mirror_mlx.errors import IncompatibleDraft

import pytest

from tests.helpers import write_tiny_gguf

# A draft equal to the target accepts whole windows, so every stop lands mid-window.
EXACT = dict(draft="self:30", gamma=6)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_eos_and_stop_string_inside_accepted_window(target, mode):
    ar = Engine(target)
    prompt = "Reply with just the word 'yes'."
    expected = ar.generate(prompt, max_tokens=40)
    assert expected.stats.finish_reason == "stop"  # EOS within the window
    with Engine(target, mode=mode, **EXACT) as engine:
        got = engine.generate(prompt, max_tokens=40)
        assert (got.token_ids, got.text) == (expected.token_ids, expected.text)
        assert got.stats.finish_reason == "stop"
        count = "Count from 1 to 30, separated by commas."
        full = ar.generate(count, max_tokens=40)
        cut = engine.generate(count, max_tokens=40, stop=["7"])
        assert cut.text == full.text[: full.text.index("7")]
        assert cut.stats.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_max_tokens_and_context_end_mid_window(target, mode):
    prompt = "Tell me about the moon."
    with Engine(target, mode=mode, **EXACT) as engine:
        r = engine.generate(prompt, max_tokens=7)
        assert len(r.token_ids) == 7 and r.stats.finish_reason == "length"
        assert r.token_ids == Engine(target).generate(prompt, max_tokens=7).token_ids
    ids = Engine(target).encode(prompt)
    context = len(ids) + 9  # room for 9 tokens: not a multiple of the window
    with Engine(target, mode=mode, context=context, **EXACT) as engine:
        r = engine.generate(prompt, max_tokens=100)
        assert r.stats.finish_reason == "context" and len(r.token_ids) == 9
        ref = Engine(target, context=context).generate(prompt, max_tokens=100)
        assert r.token_ids == ref.token_ids


def test_draft_with_another_vocabulary_is_refused(tmp_path, default_gguf, target):
    from mirror_mlx.models.gguf import read_header

    tokens = read_header(default_gguf).metadata["tokenizer.ggml.tokens"]
    path = tmp_path / "other-vocab.gguf"
    write_tiny_gguf(path, default_gguf, swap_tokens=(tokens.index("Ġthe"), tokens.index("Ġa")))
    with pytest.raises(IncompatibleDraft, match="vocabulary"):
        Engine(target, mode="sd", draft=str(path))


def test_exception_in_draft_worker_reaches_the_caller(target):
    # Without lookup, so that every step asks the draft network (whose 5th forward fails).
    with Engine(target, mode="mirror", draft="self:2", lookup=False) as engine:
        executor = engine.drafter._executor
        real_forward = executor.forward
        calls = {"n": 0}

        def failing_forward(*args):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("draft device lost")
            return real_forward(*args)

        executor.forward = failing_forward
        result = {}

        def run():
            try:
                engine.generate("Hello there!", max_tokens=16)
            except RuntimeError as e:
                result["error"] = e

        worker = threading.Thread(target=run)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "generation hung after the draft failed"
        assert "draft device lost" in str(result.get("error"))
        # The engine recovers: the draft forgets its cache and the next generation is exact.
        executor.forward = real_forward
        again = engine.generate("Hello there!", max_tokens=16).token_ids
        assert again == Engine(target).generate("Hello there!", max_tokens=16).token_ids
