"""Whether to draft at all: drafting switches itself off at a temperature where it does not pay
(steps then pay no draft forward), probes again after a pause that doubles, and stays on where
it pays; output stays the target's."""

from mirror_mlx.api import Engine
from mirror_mlx.decode.length import COPY_PROBE, FIRST_PAUSE, LONGEST, PROBE, DraftLength, Gate
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.draft.load import target_info
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.draft.net import DraftConfig, DraftNet

import mlx.core as mx
import pytest

from tests.prompts import PROMPTS


def measured(length: DraftLength) -> DraftLength:
    length.record_target(0.100, 0)  # t_1 = 100 ms
    length.record_target(0.110, 4)
    return length


def run(length: DraftLength, temperature: float, steps: int, committed: int,
        seconds: float) -> list[bool]:
    """`steps` steps; each drafting one verifies 4 tokens, commits `committed` and spends
    `seconds` drafting."""
    drafted = []
    for _ in range(steps):
        on = length.drafting(temperature)
        drafted.append(on)
        if on:
            length.record_step(temperature, committed, 4, seconds)
    return drafted


def test_drafting_that_does_not_pay_switches_off_and_is_probed_ever_less():
    length = measured(DraftLength())
    drafted = run(length, 1.0, 2000, committed=1, seconds=0.02)  # 1 token per 130 ms < AR
    assert drafted[:PROBE] == [True] * PROBE
    assert drafted[PROBE : PROBE + FIRST_PAUSE] == [False] * FIRST_PAUSE
    assert sum(drafted) == 8 * PROBE  # pauses double: 16, 32, ... 512, 512
    # Another temperature has its own measure: greedy drafting that pays stays on.
    assert all(run(length, 0.0, 200, committed=3, seconds=0.02))


def test_drafting_comes_back_where_it_pays_again():
    length = measured(DraftLength())
    run(length, 0.7, 100, committed=1, seconds=0.05)
    drafted = run(length, 0.7, 600, committed=4, seconds=0.02)
    assert drafted[-100:] == [True] * 100


def test_drafting_is_priced_with_the_measured_window_costs():
    """On a CPU a window's cost is not a line: here one draft adds 30% to a step, four 45%.
    A step committing 1.25 tokens per one-draft window earns 1.25 x 100 / 130 < 1 and
    drafting switches off (a line through the three lengths would price it at 1.15)."""
    length = DraftLength()
    for drafted, seconds in ((0, 0.100), (1, 0.130), (4, 0.145)):
        length.record_target(seconds, drafted)
    drafted = []
    for i in range(PROBE):
        drafted.append(length.drafting(1.0))
        length.record_step(1.0, 2 if i % 4 == 0 else 1, 1, 0.0)
    assert drafted == [True] * PROBE and not length.drafting(1.0)


def test_copies_are_as_long_as_they_survive_at_each_temperature():
    """A copied token costs c_v (2.5 ms here, t_1 = 100 ms): copies run to the longest window
    where they are accepted whole and otherwise stop at those that survive, one copy in
    COPY_PROBE verifying one token more (still measured); where none survives, only that one
    (its first token); each temperature on its own measure."""
    length = measured(DraftLength())
    assert length.longest_copy(1.0) == LONGEST  # nothing measured: copies as they come
    for _ in range(100):
        length.record_copy(0.0, LONGEST, LONGEST)
        length.record_copy(0.5, LONGEST, 3)
        length.record_copy(1.0, LONGEST, 0)
    for t, survive in ((0.0, LONGEST), (0.5, 3), (1.0, 0)):
        copies = [length.longest_copy(t) for _ in range(3 * COPY_PROBE)]
        probed = min(LONGEST, survive + 1)
        assert sorted(copies) == [survive] * 3 * (COPY_PROBE - 1) + [probed] * 3, (t, copies)
        assert copies[:COPY_PROBE] * 3 == copies, (t, copies)  # one in every COPY_PROBE
    # Copies that survive the token past the rule lengthen again.
    for _ in range(60):
        length.record_copy(0.5, 4, 4)
    assert length.longest_copy(0.5) == LONGEST


def test_a_copy_judges_positions_few_copies_reach_as_the_one_before():
    """Copies that ran whole through other text (an extraction) and then fail at their first
    token (a summary at temperature 1.0): the positions past the first, which no copy reaches
    any more, are forgotten as the first position's old counts are (within 60 copies), instead
    of keeping the old text's and verifying copies 10 tokens long that are rejected at once."""
    length = measured(DraftLength())
    for _ in range(100):
        length.record_copy(1.0, LONGEST, LONGEST)
    assert length.longest_copy(1.0) == LONGEST
    for i in range(60):
        length.record_copy(1.0, LONGEST, 1 if i % 3 == 0 else 0)
    assert max(length.longest_copy(1.0) for _ in range(COPY_PROBE)) <= 3, (
        length.gate(1.0).copy_acceptance())


def test_copies_are_priced_with_the_measured_window_costs():
    """Here a copied token adds 30% to a step and four add 45%: a copy whose first token is
    accepted one time in four is not worth verifying, one accepted whole is, four tokens at
    a time (a line through the lengths would price the first token at about 9%)."""
    length = DraftLength()
    for drafted, seconds in ((0, 0.100), (1, 0.130), (4, 0.145)):
        length.record_target(seconds, drafted)
    for _ in range(100):
        length.record_copy(0.7, 4, 1 if _ % 4 == 0 else 0)
        length.record_copy(0.0, 4, 4)
    assert length.longest_copy(0.7) == 0
    assert length.longest_copy(0.0) >= 4

@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_copies_verified_where_drafting_is_off_are_priced(target, mode):
    """Where drafting is off, every window verified is a copy dispatched ahead of its step;
    their cost is measured too (unmeasured, it was a guess of 1% of a step per token where this
    CPU spends 20%, and copies at temperature 1.0 ran ten tokens long)."""
    with Engine(target, mode=mode, quiet=True) as engine:
        engine.session.length.gates[1.0] = Gate(off_for=10**9)
        stats = engine.generate("Say 'red, green, blue' five times.", max_tokens=48,
                                sampling=SamplingParams(temperature=1.0, seed=0)).stats
        copied = [g for g in stats.draft_lengths if g]
        assert copied and all(g in engine.session.length.target_s for g in copied), (
            stats.draft_lengths, engine.session.length.target_s)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_copies_that_do_not_pay_are_verified_one_in_copy_probe(target, mode):
    """Drafting off, and copies priced so that not even their first token pays (verifying one
    more token costs 1.5 times what a token earns): one copy in COPY_PROBE is verified, in
    both decoders, on greedy text that repeats itself (9 in 88 steps here). Mirror-SD asked the
    gate twice a step and so verified every fourth copy (16 in 80 steps), or none, by the
    parity of its calls."""
    with Engine(target, mode=mode, quiet=True) as engine:
        length = engine.session.length
        length.gates[0.0] = Gate(off_for=10**9)
        length.target_s.update({0: 0.100, 1: 0.250})
        length.record_target = lambda seconds, drafted: None  # the prices stay as set
        stats = engine.generate("Say 'red, green, blue' five times.", max_tokens=96,
                                sampling=SamplingParams()).stats
        verified = sum(n for g, n in stats.draft_lengths.items() if g)
    assert set(stats.draft_lengths) <= {0, 1}, stats.draft_lengths
    assert 1 <= verified <= stats.target_steps // COPY_PROBE + 1, (verified, stats.target_steps)


def test_a_draft_that_never_pays_costs_few_forwards_and_changes_nothing(target):
    """With a random draft (never right), most steps pay no draft forward, and greedy output
    stays target-only decoding's."""
    mx.random.seed(0)
    config = DraftConfig(hidden_size=128, num_layers=1, intermediate_size=256, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=target.vocab_size,
                         embed_size=576, head_tokens=list(range(4096)),
                         target=target_info(target))
    net = DraftNet(config)
    net.embed_tokens = target.model.model.embed_tokens
    mx.eval(net.parameters())  # made here, computed on the draft's own thread
    settings = dict(max_tokens=48, sampling=SamplingParams())
    reference = Engine(target, mode="ar").generate(PROMPTS[0], **settings).token_ids
    with Engine(target, mode="sd", draft=MLXDrafter(net), lookup=False) as engine:
        asked = []
        submit = engine.drafter.submit
        engine.drafter.submit = lambda job: asked.append(not job.copy_only) or submit(job)
        result = engine.generate(PROMPTS[0], **settings)
    assert result.token_ids == reference
    assert sum(asked) < len(asked) / 2, (sum(asked), len(asked))


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_a_step_that_does_not_draft_computes_while_the_caller_works(target, mode):
    """As in AR, the forward of a step that does not draft is dispatched before the previous
    step's tokens are handed over, so it computes while the caller detokenizes and prints:
    whenever the caller holds new tokens the target's cache already holds the last of them
    (the old decoders started that forward only when asked for the next step). Drafting is
    held off for the whole generation; the tokens stay target-only decoding's."""
    settings = dict(max_tokens=24, sampling=SamplingParams())
    with Engine(target, mode="ar", quiet=True) as ar:
        reference = ar.generate(PROMPTS[1], **settings).token_ids
    with Engine(target, mode=mode, quiet=True, lookup=False) as engine:
        engine.session.length.gates[0.0] = Gate(off_for=10**9)
        prompt = engine.encode(PROMPTS[1])
        tokens, held = [], []
        for chunk in engine.session.generate(prompt, **settings):
            tokens += chunk.token_ids
            held.append(engine.session.cache[0].offset - len(prompt) - len(tokens))
    assert tokens == reference
    assert held[:-1] == [0] * (len(held) - 1), held
