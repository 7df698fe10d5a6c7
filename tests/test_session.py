"""The generation loop on the real default model: cache reuse, stops, streaming, cancel."""

import random
import threading

from mirror_mlx.api import Engine
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.errors import InvalidParameter, PromptTooLong
from mirror_mlx.session import Session
from mirror_mlx.text import TextStream

import pytest


@pytest.fixture()
def engine(target):
    return Engine(target, mode="ar")


def test_multi_turn_cache_reuse_equals_prefill_from_scratch(target):
    turns = ["Give me a fun fact about octopuses.", "Now one about owls.",
             "Which of the two animals is smarter?"]
    reused = Engine(target, mode="ar")
    messages, replies_reused, cached = [], [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        result = reused.generate(messages, max_tokens=24)
        replies_reused.append(result.token_ids)
        cached.append(result.stats.cached_prompt_tokens)
        messages.append({"role": "assistant", "content": result.text})
    assert cached[0] == 0 and all(c > 20 for c in cached[1:]), cached

    messages = []
    for turn, expected in zip(turns, replies_reused):
        messages.append({"role": "user", "content": turn})
        fresh = Engine(target, mode="ar")  # a new, empty cache: the whole conversation is prefilled
        result = fresh.generate(messages, max_tokens=24)
        assert result.stats.cached_prompt_tokens == 0
        assert result.token_ids == expected
        messages.append({"role": "assistant", "content": result.text})


def test_stop_string_cuts_text_and_nothing_after_is_emitted(engine):
    prompt = "Count from 1 to 20, separated by commas."
    full = engine.generate(prompt, max_tokens=60)
    assert "7" in full.text
    stopped = engine.generate(prompt, max_tokens=60, stop=["7"])
    assert stopped.stats.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("7")]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_streamed_text_equals_decoded_ids_with_multibyte_characters(engine):
    prompt = "Write five emoji, then the word 'Tokyo' in Japanese characters."
    chunks = list(engine.stream(prompt, max_tokens=48))
    ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert text == engine.tokenizer.decode(ids)
    assert any(ord(ch) > 0x2000 for ch in text), text
    assert not any("\ufffd" in c.text for c in chunks)


def test_text_stream_holds_partial_characters(target):
    tok = target.tokenizer
    ids = tok.encode("日本語 😀 ok")
    stream = TextStream(tok)
    pieces = [stream.add(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == "日本語 😀 ok"
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len("日本語 😀 ok".split()), "expected byte-level pieces"


def test_stop_string_split_across_tokens(target):
    tok = target.tokenizer
    stream = TextStream(tok, stop=["STOP HERE"])
    out = "".join(stream.add(t) for t in tok.encode("alpha beta STOP HERE gamma delta"))
    assert stream.stopped and out == "alpha beta "


def test_max_tokens_and_context_end(target):
    e = Engine(target, mode="ar")
    r = e.generate("Tell me a long story about a dragon.", max_tokens=5)
    assert r.stats.finish_reason == "length" and len(r.token_ids) == 5
    small = Engine(target, context=48, mode="ar")
    ids = small.encode("Tell me a long story about a dragon.")
    r = small.generate(ids, max_tokens=200)
    assert r.stats.finish_reason == "context"
    assert len(ids) + len(r.token_ids) == 48
    with pytest.raises(PromptTooLong):
        small.generate("word " * 100)


def test_cancel_stops_and_session_goes_on(engine):
    cancel = threading.Event()
    got = []
    for chunk in engine.stream("Write a long essay about rivers.", max_tokens=200, cancel=cancel):
        got.extend(chunk.token_ids)
        if len(got) >= 3:
            cancel.set()
        if chunk.stats:
            assert chunk.stats.finish_reason == "cancelled"
    assert 3 <= len(got) < 10
    after = engine.generate("Say hi.", max_tokens=8)
    alone = Engine(engine.target, mode="ar").generate("Say hi.", max_tokens=8)
    assert after.token_ids == alone.token_ids


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(engine):
    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        return engine.generate("Invent a name for a cat.", max_tokens=16, sampling=p).token_ids

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_bad_generation_arguments(target):
    s = Session(target)
    with pytest.raises(InvalidParameter):
        list(s.generate([], max_tokens=4))
    with pytest.raises(InvalidParameter):
        list(s.generate([1, 2], max_tokens=0))


def test_stop_overlap_is_the_longest_end_that_starts_a_stop():
    """The held-back text (the longest end of the text that could start a stop string) is found
    in linear time and equals the plain definition, on random texts over a small alphabet
    where ends and starts overlap often."""
    from mirror_mlx.text import _overlap, _prefix_table

    def plain(text, stop):
        return max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)

    rng = random.Random(0)
    for _ in range(3000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 9)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        if stop in text:
            continue
        assert _overlap(text, stop, _prefix_table(stop)) == plain(text, stop), (text, stop)
