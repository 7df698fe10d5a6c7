"""Whether to draft at all: drafting switches itself off at a temperature where it does not pay
(steps then pay no draft forward), probes again after a pause that doubles, and stays on where
it pays; output stays the target's."""

from mirror_mlx.api import Engine
from mirror_mlx.decode.length import FIRST_PAUSE, PROBE, DraftLength
from mirror_mlx.decode.sampling import SamplingParams

from tests.prompts import PROMPTS


def measured(length: DraftLength) -> DraftLength:
    length.record_target(0.100, 0)  # t_1 = 100 ms
    length.record_target(0.110, 4)
    return length


def run(length: DraftLength, temperature: float, steps: int, committed: int,
        seconds: float) -> list[bool]:
    """`steps` steps; each drafting one commits `committed` tokens in `seconds`."""
    drafted = []
    for _ in range(steps):
        on = length.drafting(temperature)
        drafted.append(on)
        if on:
            length.record_step(temperature, committed, seconds)
    return drafted


def test_drafting_that_does_not_pay_switches_off_and_is_probed_ever_less():
    length = measured(DraftLength())
    drafted = run(length, 1.0, 2000, committed=1, seconds=0.13)  # 1 token per 130 ms < AR
    assert drafted[:PROBE] == [True] * PROBE
    assert drafted[PROBE : PROBE + FIRST_PAUSE] == [False] * FIRST_PAUSE
    assert sum(drafted) == 8 * PROBE  # pauses double: 16, 32, ... 512, 512
    # Another temperature has its own measure: greedy drafting that pays stays on.
    assert all(run(length, 0.0, 200, committed=3, seconds=0.15))


def test_drafting_comes_back_where_it_pays_again():
    length = measured(DraftLength())
    run(length, 0.7, 100, committed=1, seconds=0.2)
    drafted = run(length, 0.7, 600, committed=4, seconds=0.15)
    assert drafted[-100:] == [True] * 100


def test_a_draft_that_never_pays_costs_few_forwards_and_changes_nothing(target):
    """With a draft of the target's first layer (rarely right), most steps pay no draft
    forward, and greedy output stays target-only decoding's."""
    settings = dict(max_tokens=48, sampling=SamplingParams())
    reference = Engine(target).generate(PROMPTS[0], **settings).token_ids
    with Engine(target, mode="sd", draft="self:1", lookup=False) as engine:
        asked = []
        submit = engine.drafter.submit
        engine.drafter.submit = lambda job: asked.append(not job.copy_only) or submit(job)
        result = engine.generate(PROMPTS[0], **settings)
    assert result.token_ids == reference
    assert sum(asked) < len(asked) / 2, (sum(asked), len(asked))
