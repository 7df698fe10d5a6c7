"""Mirror-SD's paths on the real target: reuse of the early rollout, of a branch at the first
and at a later position, and fallback; the caches stay consistent; the overlap is real."""

import time
from collections import Counter

from mirror_mlx.api import Engine

import pytest

from tests.prompts import PROMPTS


def outcomes(engine) -> Counter:
    """How each step ended: early, branch:first (A = 0), branch:later (A > 0), fallback."""
    kinds = Counter()
    for label, _, _ in engine.session.timeline:
        if label.startswith("outcome:"):
            kind = label.removeprefix("outcome:")
            if kind.startswith("branch:"):
                kind = "branch:first" if kind == "branch:0" else "branch:later"
            kinds[kind] += 1
    return kinds


@pytest.fixture(scope="module")
def reference(target):
    engine = Engine(target, mode="ar")
    return {p: engine.generate(p, max_tokens=32).token_ids for p in PROMPTS[:2]}


def test_every_path_taken_and_tokens_identical(target, reference):
    seen = Counter()
    # The shipped draft over a short window is right often enough for every outcome (measured
    # here on the two prompts: 5 early, 15 branch hits at the first position, 4 later, 16
    # fallbacks), at a tenth of a draft of the target's own layers' cost.
    with Engine(target, mode="mirror", draft="default", gamma=3, kappa=8,
                branch_budget=4) as engine:
        for prompt, expected in reference.items():
            engine.session.reset()
            engine.session.timeline = []
            assert engine.generate(prompt, max_tokens=32).token_ids == expected
            seen += outcomes(engine)
            labels = [label for label, _, _ in engine.session.timeline]
            assert sum(label.startswith("outcome:") for label in labels) > 0
    # Each step ends in exactly one of: early reuse, branch reuse at A = 0, at A > 0, fallback.
    for kind in ("early", "branch:first", "branch:later", "fallback"):
        assert seen[kind] > 0, seen


def test_caches_consistent_across_turns(target):
    """Generation after generation in one session (cache reuse, rollbacks, reused branches)
    equals target-only decoding of the whole conversation from scratch."""
    messages = []
    with Engine(target, mode="mirror", gamma=3, kappa=8, branch_budget=4) as engine:
        for turn in ("Name a planet.", "Is it bigger than Earth?", "Name another one."):
            messages.append({"role": "user", "content": turn})
            result = engine.generate(messages, max_tokens=20)
            session = engine.session
            assert session.cache[0].offset == len(session.tokens)
            ids = engine.encode(messages)
            assert session.tokens == (ids + result.token_ids)[: len(session.tokens)]
            fresh = Engine(target, mode="ar").generate(messages, max_tokens=20)
            assert result.token_ids == fresh.token_ids
            messages.append({"role": "assistant", "content": result.text})


def test_draft_work_overlaps_the_target(target):
    """The draft computes while the target does. How much of its work the target hides is a
    ratio of two threads' speeds on shared cores (the bench reports it; it varies by machine),
    so what is asserted is that draft forwards ran from start to end inside the target's
    spans: a serial schedule, or a draft stalled while the target computes, runs none there.
    A short window (gamma 2) keeps the early rollout (gamma + 1 forwards on the one worker)
    well inside the target's step (110 against 207 ms here; with gamma 5, 291 against 294),
    so that the branch rollouts queued behind it start while the suffix still runs."""
    with Engine(target, mode="mirror", draft="self:6", gamma=2, branch_budget=4) as engine:
        executor = engine.drafter.inner._executor  # inside the prompt-lookup wrapper
        forward, forwards = executor.forward, []

        def timed(*args):
            start = time.perf_counter()
            out = forward(*args)
            forwards.append((start, time.perf_counter()))
            return out

        executor.forward = timed
        engine.session.timeline = []
        stats = engine.generate(PROMPTS[0], max_tokens=24).stats
        spans = {}
        for label, start, end in engine.session.timeline:
            spans.setdefault(label, []).append((start, end))

    def overlap(a, b):
        return sum(max(0.0, min(x[1], y[1]) - max(x[0], y[0])) for x in a for y in b)

    # Branch rollouts run while the target's suffix runs; the early rollout beside its prefix.
    assert overlap(spans["draft_branches"], spans["target_suffix"]) > 0
    assert overlap(spans["draft_early"], spans["target_prefix"]) > 0
    target_spans = spans["target_prefix"] + spans["target_suffix"]
    inside = [f for f in forwards if any(s <= f[0] and f[1] <= e for s, e in target_spans)]
    assert inside, f"none of {len(forwards)} draft forwards ran while the target computed"
    assert stats.overlap_fraction > 0


def test_each_job_stops_on_its_own(target, reference):
    """Verification that hits a branch makes the early rollout useless: it is stopped, so it
    no longer holds the draft's worker ahead of the branch job that is of use; the branch job
    is stopped only where no branch was hit."""
    with Engine(target, mode="mirror", gamma=5, kappa=8, branch_budget=4,
                lookup=False) as engine:
        jobs = []
        submit = engine.drafter.submit

        def recorded(job):
            jobs.append((job.label, job.cancel))
            return submit(job)

        engine.drafter.submit = recorded
        engine.session.timeline = []
        prompt, expected = next(iter(reference.items()))
        assert engine.generate(prompt, max_tokens=32).token_ids == expected
        outcomes = [label.removeprefix("outcome:") for label, _, _ in engine.session.timeline
                    if label.startswith("outcome:")]
    steps = [(jobs[i][1], jobs[i + 1][1]) for i in range(len(jobs) - 1)
             if jobs[i][0] == "early" and jobs[i + 1][0] == "branches"]
    assert len(steps) == len(outcomes)
    hits = [(early, late) for (early, late), outcome in zip(steps, outcomes)
            if outcome.startswith("branch:") and int(outcome.split(":")[1]) < 5]
    assert hits, outcomes
    assert all(early.is_set() and not late.is_set() for early, late in hits)
    assert all(late.is_set() for (_, late), outcome in zip(steps, outcomes)
               if outcome == "fallback")
