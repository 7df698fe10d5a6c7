"""Greedy identity with target-only decoding: a run's first difference is a tie only where the
target's two best tokens are equal up to rounding both ways (one token at a time, and in a
window); anything else is a mismatch. The tie is made exact on the real default target by
giving the runner-up the best token's output row."""

import json
from contextlib import contextmanager

from mirror_mlx.api import Engine
from mirror_mlx.bench.harness import BenchConfig, BenchResult, EnergyResult, Run, check_identity
from mirror_mlx.bench.identity import END, TIE_ULPS, compare, summary, ulp
from mirror_mlx.bench.report import markdown, summarize, to_json
from mirror_mlx.decode.stats import GenerationStats
from mirror_mlx.errors import InvalidParameter
from mirror_mlx.selftest import PROMPTS, identity_check, run_check

import mlx.core as mx
import numpy as np
import pytest

MAX_TOKENS = 8
AT = 3  # where the tie is made


@contextmanager
def tied(target, best: int, runner_up: int):
    """The target with `runner_up`'s output row (tied to its embedding) made `best`'s: the two
    tokens' logits are then equal bit for bit at every position, computed either way."""
    embed = target.model.model.embed_tokens
    old = embed.weight
    rows = np.array(old)
    rows[runner_up] = rows[best]
    embed.weight = mx.array(rows)
    try:
        yield
    finally:
        embed.weight = old


@pytest.fixture(scope="module")
def reply(target):
    engine = Engine(target, mode="ar")
    prompt = engine.encode(PROMPTS[0])
    ids = engine.generate(prompt, max_tokens=MAX_TOKENS).token_ids
    engine.close()
    assert len(ids) == MAX_TOKENS
    logits = target.model(mx.array([prompt + ids[:AT]]))[0, -1]
    order = np.argsort(-np.array(logits))
    assert order[0] == ids[AT]
    return prompt, ids, [int(t) for t in order[:3]]


def test_identical_runs_are_identical(target, reply):
    prompt, ids, _ = reply
    result = compare(target, prompt, ids, list(ids))
    assert result.verdict == "identical" and result.passed and result.position is None
    with pytest.raises(InvalidParameter):
        compare(target, [], ids, ids[:2])


def test_a_difference_at_an_exact_tie_is_a_tie(target, reply):
    prompt, ids, (best, second, third) = reply
    with tied(target, best, second):
        engine = Engine(target, mode="ar")
        reference = engine.generate(prompt, max_tokens=MAX_TOKENS).token_ids
        engine.close()
        # Both tokens now have the same logit and input row: the path is the same, with the
        # tie broken one way wherever either is the best.
        assert [t if t not in (best, second) else best for t in reference] == \
            [t if t not in (best, second) else best for t in ids]
        at = next(i for i, t in enumerate(reference) if t in (best, second))
        assert at <= AT
        taken = reference[at]
        other = reference[:at] + [best + second - taken] + reference[at + 1:]
        result = compare(target, prompt, reference, other)
        assert (result.verdict, result.position) == ("tie", at) and result.passed
        assert (result.reference_token, result.other_token) == (taken, best + second - taken)
        assert result.texts == {t: target.tokenizer.decode([t]) for t in (best, second)}
        assert result.dtype == "float32" and result.window_tokens == 1 + MAX_TOKENS - at
        assert result.tolerance == TIE_ULPS["float32"] * ulp(result.one_token.largest, "float32")
        assert result.tolerance < 1e-4  # float32 on the CPU: tight
        for way in (result.one_token, result.window):
            assert way.argmax == taken and way.runner_up == best + second - taken
            assert way.gap == 0.0 and way.reference_below_best == way.other_below_best == 0.0
        text = summary([compare(target, prompt, reference, reference), result])
        assert text.startswith(f"identical on 1 of 2 prompts; prompt 2: tie at token {at}: ")
        assert "top-2 gap 0 one token at a time" in text and f"window of {1 + MAX_TOKENS - at}" \
            in text and "16 ulps of float32" in text

        tied_result = result

        # The third-best token there is no tie: a real failure.
        wrong = reference[:at] + [third] + reference[at + 1:]
        result = compare(target, prompt, reference, wrong)
        assert (result.verdict, result.position, result.other_token) == ("mismatch", at, third)
        assert not result.passed and result.one_token.other_below_best > result.tolerance

    # doctor --selftest's identity checks: the tie passes, stated; the mismatch fails.
    check = run_check("identity", lambda: identity_check([tied_result]))
    assert check.status == "ok" and check.detail.startswith(
        f"identical on 0 of 1 prompts; prompt 1: tie at token {at}: ")
    check = run_check("identity", lambda: identity_check([tied_result, result]))
    assert check.status == "FAIL" and check.detail.startswith(
        "greedy output differs from target-only decoding: identical on 0 of 2 prompts; "
        f"prompt 1: tie at token {at}: ") and f"; prompt 2: mismatch at token {at}: " \
        in check.detail


def test_the_runner_up_of_the_real_target_is_a_mismatch(target, reply):
    """Unedited, the default target's best and second tokens at AT are far apart in float32."""
    prompt, ids, (best, second, _) = reply
    other = ids[:AT] + [second] + ids[AT + 1:]
    result = compare(target, prompt, ids, other)
    assert (result.verdict, result.position) == ("mismatch", AT)
    for way in (result.one_token, result.window):
        assert way.argmax == best and way.runner_up == second
        assert way.gap > 100 * result.tolerance
    assert result.window_tokens == 1 + MAX_TOKENS - AT
    assert "mismatch at token 3: " in summary([result])


def test_a_run_that_ends_early_ends_at_its_difference(target, reply):
    prompt, ids, _ = reply
    result = compare(target, prompt, ids, ids[:AT])
    assert (result.verdict, result.position) == ("mismatch", AT)
    assert (result.reference_token, result.other_token) == (ids[AT], END)
    assert result.window_tokens == 1  # nothing followed: the prefix's last token alone
    assert "<end>" in result.describe()


def test_the_bench_counts_ties_and_mismatches(target, reply, tmp_path):
    """Greedy agreement per mode: the identical generations, then each differing one with its
    verdict, in bench.json and bench.md; a later turn after a differing reply is not compared."""
    prompt, ids, (best, second, third) = reply
    with tied(target, best, second):
        engine = Engine(target, mode="ar")
        reference = engine.generate(prompt, max_tokens=MAX_TOKENS).token_ids
        engine.close()
        at = next(i for i, t in enumerate(reference) if t in (best, second))
        tie = reference[:at] + [best + second - reference[at]] + reference[at + 1:]
        wrong = reference[:at] + [third] + reference[at + 1:]

        def run(mode, turn, tokens, ids=prompt):
            return Run(mode, "7", "qa", turn, 0, tokens, 1, 0.1, 0.2, GenerationStats(), ids)

        later = prompt + [1, 2]
        runs = [run("ar", 0, reference), run("ar", 1, reference, later),
                run("sd", 0, list(reference)), run("sd", 1, wrong, later),
                run("mirror", 0, tie), run("mirror", 1, wrong, prompt + tie)]
        config = BenchConfig(modes=("ar", "sd", "mirror"), max_tokens=MAX_TOKENS)
        check_identity(target, runs, config)
    result = BenchResult(config, runs, EnergyResult("none", "unavailable: a test"), [], {})
    agreement = summarize(result)["greedy_agreement"]
    assert {m: (a["identical"], a["total"], a["ties"], a["mismatches"], a["not_compared"])
            for m, a in agreement.items()} == {"sd": (1, 2, 0, 1, 0), "mirror": (0, 2, 1, 0, 1)}
    tie_run = agreement["mirror"]["differ"][0]
    assert (tie_run["turn"], tie_run["at"], tie_run["verdict"]) == (0, at, "tie")
    assert tie_run["identity"]["one_token"]["gap"] == tie_run["identity"]["window"]["gap"] == 0
    assert agreement["mirror"]["differ"][1]["verdict"] == "not compared"
    assert agreement["sd"]["differ"][0]["verdict"] == "mismatch"

    doc = to_json(result, summarize(result), target, "test", "test")
    doc = json.loads(json.dumps(doc))  # as bench.json holds it
    assert doc["runs"][4]["identity"]["verdict"] == "tie" and doc["runs"][2]["identity"] is None
    md = markdown(doc, {})
    assert "- SD (ours): 1/2 generations token-identical, 0 ties, 1 mismatches" in md
    assert "- Mirror-SD (ours): 0/2 generations token-identical, 1 ties, 0 mismatches, " \
        "1 not compared" in md
    assert f"  - q7.1, repeat 1: tie at token {at}: " in md
    name = lambda t: f"{t} {target.tokenizer.decode([t])!r}"  # noqa: E731
    assert f"  - q7.2, repeat 1: mismatch at token {at}: {name(reference[at])} (target-only) " \
        f"vs {name(third)}; the target's top-2 gap " in md
