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
    ar = Engine(target, mode="ar")
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
        assert r.token_ids == Engine(target, mode="ar").generate(prompt, max_tokens=7).token_ids
    ids = Engine(target, mode="ar").encode(prompt)
    context = len(ids) + 9  # room for 9 tokens: not a multiple of the window
    with Engine(target, mode=mode, context=context, **EXACT) as engine:
        r = engine.generate(prompt, max_tokens=100)
        assert r.stats.finish_reason == "context" and len(r.token_ids) == 9
        ref = Engine(target, context=context, mode="ar").generate(prompt, max_tokens=100)
        assert r.token_ids == ref.token_ids


def test_draft_with_another_vocabulary_is_refused(tmp_path, default_gguf, target):
    from mirror_mlx.models.gguf import read_header

    tokens = read_header(default_gguf).metadata["tokenizer.ggml.tokens"]
    path = tmp_path / "other-vocab.gguf"
    write_tiny_gguf(path, default_gguf, swap_tokens=(tokens.index("Ġthe"), tokens.index("Ġa")))
    with pytest.raises(IncompatibleDraft, match="vocabulary"):
        Engine(target, mode="sd", draft=str(path))


def on_draft_forward(engine, n: int, act) -> None:
    """Make the draft run `act()` before its n-th forward (the draft network's executor)."""
    executor = engine.drafter._executor
    real_forward = executor.forward
    calls = {"n": 0}

    def forward(*args):
        calls["n"] += 1
        if calls["n"] == n:
            act()
        return real_forward(*args)

    executor.forward = forward


def test_a_draft_that_fails_mid_generation_leaves_the_target_to_finish(target):
    """The draft's 5th forward raises: the generation goes on as target-only decoding from the
    last committed token (greedy output unchanged), says why, and the next generation drafts
    again (the draft forgot its cache)."""
    expected = Engine(target, mode="ar").generate("Hello there!", max_tokens=16).token_ids
    # Without lookup, so that every step asks the draft network; a fixed window, so that
    # every step drafts (with --gamma auto, measured seconds decide how many tokens a step
    # drafts and whether it drafts at all, and `draft_tokens` below could be 0 on a machine
    # where the draft costs more against the target).
    with Engine(target, mode="mirror", draft="self:2", lookup=False, gamma=4) as engine:
        def lose_device():
            raise RuntimeError("draft device lost")

        on_draft_forward(engine, 5, lose_device)
        with pytest.warns(UserWarning, match="draft device lost"):
            result = engine.generate("Hello there!", max_tokens=16)
        assert result.token_ids == expected
        assert "draft device lost" in result.stats.draft_fault
        again = engine.generate("Hello there!", max_tokens=16)
        assert again.token_ids == expected and not again.stats.draft_fault
        assert again.stats.draft_tokens > 0


def test_a_draft_that_hangs_is_given_up_after_a_bounded_wait(target, monkeypatch):
    """A draft job that never returns is abandoned after DRAFT_WAIT_S: the generation finishes
    with the target alone, and the session stops asking that draft (it says so)."""
    from mirror_mlx.decode import speculative

    monkeypatch.setattr(speculative, "DRAFT_WAIT_S", 2.0)
    expected = Engine(target, mode="ar").generate("Hello there!", max_tokens=12).token_ids
    release = threading.Event()
    with Engine(target, mode="sd", draft="self:2", lookup=False) as engine:
        on_draft_forward(engine, 4, lambda: release.wait(60))
        try:
            with pytest.warns(UserWarning, match="did not return"):
                result = engine.generate("Hello there!", max_tokens=12)
            assert result.token_ids == expected
            again = engine.generate("Hello there!", max_tokens=12)
            assert again.token_ids == expected and again.stats.draft_tokens == 0
            assert "did not return" in again.stats.draft_fault
        finally:
            release.set()
