"""Mirror speculative decoding, one step at a time, top to bottom.

A step verifies a window of drafted tokens. While the target computes, the draft rolls out the
windows the next step may need, so that on a hit the next window is ready when verification
ends (reuse) and only on a miss does the draft work on the critical path (fallback):

1. The draft starts at once on the likeliest outcome, "all drafts accepted, then the draft's
   own next token": it continues its own window by gamma + 1 tokens.
2. The target runs layers 1..l_e over the window; the early exit gives top-kappa guesses of
   the target's token at every window position (ids and log-probs: the token channel).
3. The draft rolls out the best-ranked other outcomes (r accepted, then token v) as one
   batched job, beside the target's remaining layers l_e+1..N.
4. Verification (greedy, or speculative sampling) commits A drafts and the target's token c.
5. If (A, c) was rolled out, its rollout is the next window; otherwise the next window is
   drafted afresh.

How much of this runs is the scheduler's choice, step by step (decode/schedule.py): where the
draft shares the target's compute, work beside the target is not free, and a step may skip
1-3 (plain SD's serial step) or 2-3 (no split: the early rollout only).

How the two sides run at once is the drafter's business: a threaded drafter (MLX on a worker
thread) starts jobs when they are submitted; an inline one (Core ML on the Neural Engine) runs
them in `run_pending`, after the target's work has been dispatched with `mx.async_eval`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft.base import Drafter, Features, Job, Rollout
from ..measure.stats import GenerationStats
from ..models import split
from .branches import rank_branches
from .length import DraftLength
from .sampling import Sampler
from .schedule import Scheduler, scheduler_for
from .verify import judge, speculative_accept


@dataclass
class MirrorConfig:
    gamma: int | DraftLength = 5  # a fixed window, or the adaptive length's state
    kappa: int = 8
    exit_layer: int = 25
    budget: int | None = None  # branches beside the suffix (None: auto, see schedule.py)
    source: str = "union"  # where branch tokens come from: exit | draft | union
    exit_head: split.ExitHead | None = None
    exit_vocab: split.ExitVocab | None = None  # the exit's reduced output layer
    separate_units: bool = False  # the draft has compute of its own though on the same device


def _tail(r: Rollout, skip: int) -> Rollout:
    return Rollout(r.tokens[skip:], r.top_ids[skip:], r.top_probs[skip:],
                   None if r.probs is None else r.probs[skip:], r.ended)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def mirror(model: nn.Module, cache: list, drafter: Drafter, committed: list[int],
           sampler: Sampler, stats: GenerationStats, config: MirrorConfig, limit: int,
           scheduler: Scheduler | None = None, timeline: list | None = None,
           features: list[Features] | None = None,
           accept=speculative_accept) -> Iterator[list[int]]:
    """Yields the tokens each step commits; same contract as `speculative`. `scheduler`
    chooses each step's plan (a session keeps one across generations).

    A draft that reads the target's features gets those of each step's committed tokens with
    its next job; the branch rollouts read the window's features at the early exit (the
    feature layers lie at or below it), before verification has ended."""
    if scheduler is None:
        scheduler = scheduler_for(drafter, config.budget, config.separate_units)
    committed = list(committed)
    q_params = None if sampler.params.greedy else sampler.params
    n_layers = len(model.layers)
    exit_layer = config.exit_head.layer if config.exit_head else config.exit_layer
    taps = drafter.feature_layers
    pending = list(features or [])  # features the draft has not been sent yet
    length = config.gamma if isinstance(config.gamma, DraftLength) else None
    window: Rollout | None = None
    vocab = None  # the exit's vocabulary for this generation, made on the first split step
    played: tuple[int, float] | None = None  # the last step's plan and when its window was ready

    def mark(label: str, start: float, end: float) -> None:
        if timeline is not None:
            timeline.append((label, start, end))

    while True:
        longest = length.longest if length else config.gamma
        g = max(0, min(longest, limit - len(committed)))
        confidence = length.threshold() if length else 0.0
        if g and (window is None or (len(window.tokens) < g and not window.ended)):
            t = time.perf_counter()
            done = drafter.submit(Job([committed], g, q_params, "fresh", features=pending,
                                      min_confidence=confidence, committed=committed)).result()
            pending = []
            window = done.rollouts[0]
            stats.add_time("draft_serial", time.perf_counter() - t)
            mark("draft_fresh", t, time.perf_counter())
            if length and not done.extra.get("lookup"):
                length.record_draft(done.end - done.start, max(1, done.forwards))
        drafts = window.tokens[:g] if g else []
        g = len(drafts)
        ready = time.perf_counter()
        if played is not None:
            scheduler.record(played[0], ready - played[1])
        index = scheduler.choose()
        plan = scheduler.plans[index]
        played = (index, ready)
        stats.plan_steps[plan.name] = stats.plan_steps.get(plan.name, 0) + 1
        q = window.probs[:g] if g and window.probs is not None else None
        stop = threading.Event()
        window_ids = mx.array([committed[-1:] + drafts])

        # 1. The likeliest outcome needs no early-exit signal: start it now.
        early = None
        if g and plan.early:
            early = drafter.submit(Job([committed + drafts], longest + 1, q_params, "early", True,
                                       stop, pending, confidence, committed))
            pending = []

        picks, late = [], None
        t_start = time.perf_counter()
        split_pass = bool(g and plan.branches)
        if split_pass:
            # 2. Target prefix, then the early exit's top-kappa at every window position.
            if vocab is None and config.exit_vocab is not None:
                vocab = config.exit_vocab.with_tokens(model, committed)
            p = split.start(model, window_ids, cache, taps)
            split.run_layers(model, p, 0, exit_layer)
            seen = []  # the window's features at the exit, for the branches
            if taps and len(p.features) == len(taps):
                seen = [Features.of(committed + drafts, len(committed) - 1, p.features)]
            exit_ids, exit_logp = split.exit_top_k(model, p.h[0], config.exit_head, vocab,
                                                   config.kappa)
            mx.async_eval(exit_ids, exit_logp)
            drafter.run_pending()
            mx.eval(exit_ids, exit_logp)
            t_suffix = time.perf_counter()
            stats.add_time("target_prefix", t_suffix - t_start)
            mark("target_prefix", t_start, t_suffix)

            # 3. The other likely outcomes, rolled out beside the target's suffix.
            picks = rank_branches(
                drafts, np.array(exit_ids), np.array(exit_logp), window.top_ids[:g],
                window.top_probs[:g], plan.branches, config.source)
            late = drafter.submit(Job([committed + drafts[: b.r] + [b.token] for b in picks],
                                      longest, q_params, "branches", False, stop,
                                      pending + seen, confidence, committed))
            pending = []

            # 4. Target suffix and verification.
            split.run_layers(model, p, exit_layer, n_layers)
            logits = split.final_logits(model, p.h[0])
            feats = p.features
        else:
            # 4. The whole target forward, unsplit: nothing waits for an exit readout.
            t_suffix = t_start
            logits, feats = split.forward(model, window_ids, cache, taps)
            logits = logits[0]
        mx.async_eval(logits)
        drafter.run_pending()
        accepted, token = judge(logits, drafts, q, sampler, accept)
        for c in cache:
            c.trim(g - accepted)
        if taps:
            pending.append(Features.of(committed + drafts[:accepted] + [token],
                                       len(committed) - 1, feats, accepted + 1))
        t_done = time.perf_counter()
        if split_pass:
            # Positions 0..A saw committed context: there the early exit's guess can be scored.
            guessed = np.array(exit_ids[: accepted + 1])
            truth = np.array(drafts[:accepted] + [token])[:, None]
            stats.exit_positions += accepted + 1
            stats.exit_covered += int((guessed == truth).any(axis=1).sum())
        stats.add_time("target_suffix" if split_pass else "target", t_done - t_suffix)
        if length:
            length.record_target(t_done - t_start, g)
            stats.draft_lengths[g] = stats.draft_lengths.get(g, 0) + 1
        mark("target_suffix" if split_pass else "target", t_suffix, t_done)

        # 5. Reuse a rollout of the actual outcome, or fall back to drafting afresh.
        window = None
        if early is not None:
            hit = next((i for i, b in enumerate(picks) if (b.r, b.token) == (accepted, token)),
                       None)
            if hit is None and accepted < g:
                stop.set()  # neither job can be of use any more: end them early
            wait = time.perf_counter()
            early_done = early.result()
            outcome = "fallback"
            if accepted == g and early_done.rollouts[0].tokens[:1] == [token]:
                window, outcome = _tail(early_done.rollouts[0], 1), "early"
            late_done = late.result() if late is not None else None
            if window is None and hit is not None:
                window, outcome = late_done.rollouts[hit], f"branch:{accepted}"
            mark(f"outcome:{outcome}", t_done, t_done)
            stats.add_time("wait", time.perf_counter() - wait)
            target_span = (t_start, t_done)
            for job in filter(None, (early_done, late_done)):
                busy = (job.start, job.end)
                stats.add_time("draft", busy[1] - busy[0])
                stats.add_time("draft_hidden", _overlap(busy, target_span))
                mark(f"draft_{job.label}", *busy)
            if window is not None:
                stats.reuse_steps += 1
            else:
                stats.fallback_steps += 1
        stats.record_step(g, accepted)
        new = drafts[:accepted] + [token]
        committed += new
        yield new
