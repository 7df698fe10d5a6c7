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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft.base import DRAFT_WAIT_S, Drafter, Features, Job, Rollout
from ..models import split
from .branches import rank_branches
from .length import DraftLength
from .sampling import Sampler
from .schedule import Scheduler, draft_units, scheduler_for
from .speculative import Window
from .stats import GenerationStats
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
                   None if r.probs is None else r.probs[skip:], r.ended, r.copied)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class Landing:
    """When the target's dispatched work really completes. An inline drafter computes on the
    caller's thread, so the caller cannot see the target land while a draft job runs: a thread
    waits for it instead (`mx.eval` of work already dispatched releases the GIL and only
    waits) and notes when each group of arrays is done."""

    def __init__(self, groups: list[list[mx.array]]):
        self.times: list[float | None] = [None] * len(groups)
        self.landed = threading.Event()
        self._thread = threading.Thread(target=self._wait, args=(groups,),
                                        name="mirror-landing", daemon=True)
        self._thread.start()

    def _wait(self, groups: list[list[mx.array]]) -> None:
        try:
            for i, group in enumerate(groups):
                mx.eval(*group)
                self.times[i] = time.perf_counter()
        except Exception:
            return  # the caller's own evaluation raises it
        self.landed.set()

    def join(self) -> list[float | None]:
        self._thread.join()
        return self.times


class Verdict:
    """The step's verification (accepted drafts, the target's token), judged once: by the
    decoder after the draft's work, or earlier, as soon as the target has landed, when an
    inline job asks whether it is still of use (inline jobs run on the decoder's thread, so
    judging there keeps the sampler's draws in order)."""

    def __init__(self, judge_step: Callable[[], tuple[int, int]], landing: Landing | None):
        self._judge = judge_step
        self._landing = landing
        self._result: tuple[int, int] | None = None

    def known(self) -> tuple[int, int] | None:
        if self._result is None and self._landing is not None and self._landing.landed.is_set():
            self._result = self._judge()
        return self._result

    def result(self) -> tuple[int, int]:
        if self._result is None:
            self._result = self._judge()
        return self._result


@dataclass
class Stop:
    """A job's cancel flag (`Job.cancel`), one per job: set once verification shows that its
    rollouts cannot be the next window. Asked from an inline job (`verdict` given), it judges
    the step as soon as the target lands, so such a job stops then instead of delaying it."""

    useful: Callable[[tuple[int, int]], bool]  # can a rollout serve (accepted, token)?
    verdict: Verdict | None = None
    event: threading.Event = field(default_factory=threading.Event)

    def is_set(self) -> bool:
        if not self.event.is_set() and self.verdict is not None:
            known = self.verdict.known()
            if known is not None:
                self.settle(*known)
        return self.event.is_set()

    def settle(self, accepted: int, token: int) -> None:
        if not self.useful((accepted, token)):
            self.event.set()


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
    scheduler.begin()
    own_unit = draft_units(drafter, config.separate_units)[0]
    committed = list(committed)
    q_params = None if sampler.params.greedy else sampler.params
    n_layers = len(model.layers)
    exit_layer = config.exit_head.layer if config.exit_head else config.exit_layer
    taps = drafter.feature_layers
    pending = list(features or [])  # features the draft has not been sent yet
    length = config.gamma if isinstance(config.gamma, DraftLength) else None
    window: Rollout | None = None
    vocab = None  # the exit's vocabulary for this generation, made on the first split step
    # The plan whose step produced the current window, and when that step began: a plan is
    # charged the seconds to the next window and credited the tokens that window commits.
    played: tuple[int, float] | None = None
    charged: tuple[int, float] | None = None

    def mark(label: str, start: float, end: float) -> None:
        if timeline is not None:
            timeline.append((label, start, end))

    def room() -> int:
        """The most tokens the step may draft."""
        return max(0, min(length.longest if length else config.gamma, limit - len(committed)))

    def copy_room() -> int | None:
        """The most tokens a copy from the context may draft."""
        return length.longest_copy(sampler.params.temperature) if length else None

    def take_window(g: int, drafting: bool, copies: int | None
                    ) -> tuple[list[int], np.ndarray | None, bool, float]:
        """The step's drafts (a rolled-out window's, or a fresh job's: only a copy from the
        context where the step does not draft), their distributions q, whether they are a
        copy from the context, and the seconds drafting took on the critical path."""
        nonlocal window, pending
        spent = 0.0
        if g and (window is None or (len(window.tokens) < g and not window.ended)):
            t = time.perf_counter()
            done = drafter.submit(Job([committed], g, q_params, "fresh", features=pending,
                                      min_confidence=length.threshold() if length else 0.0,
                                      committed=committed, copy_only=not drafting,
                                      longest_copy=copies)
                                  ).result(DRAFT_WAIT_S)
            pending = []
            window = done.rollouts[0]
            spent = time.perf_counter() - t
            stats.add_time("draft_serial", spent)
            mark("draft_fresh", t, time.perf_counter())
            if length and not window.copied:
                length.record_draft(done.end - done.start, max(1, done.forwards))
        drafts = window.tokens[:g] if g else []
        q = window.probs[: len(drafts)] if drafts and window.probs is not None else None
        return drafts, q, bool(drafts) and window.copied, spent

    drafting = length is None or length.drafting(sampler.params.temperature)
    ahead: Window | None = None  # the step's window, when dispatched before the last yield
    while True:
        longest = length.longest if length else config.gamma
        asked = room()
        confidence = length.threshold() if length else 0.0
        # A window dispatched ahead (a step that does not draft) has had its copy priced; asked
        # again, the gate would count a held copy that is never verified.
        copies = None if ahead else copy_room()
        # `spent`: drafting on this step's critical path.
        drafts, q, copied, spent = (ahead.drafts, ahead.q, ahead.copied, 0.0) if ahead else \
            take_window(asked, drafting, copies)
        g = len(drafts)
        ready = time.perf_counter()
        charged = None if played is None else (played[0], ready - played[1])
        # A step that does not draft runs no plan: it is neither chosen nor charged.
        index = scheduler.choose() if drafting else 0
        plan = scheduler.plans[index]
        played = (index, ready) if drafting else None
        if drafting:
            stats.plan_steps[plan.name] = stats.plan_steps.get(plan.name, 0) + 1
        # Each job stops on its own: a branch hit must not wait behind an early rollout that
        # verification has made useless, nor the reverse.
        early_stop = Stop(lambda outcome, g=g: outcome[0] == g)
        late_stop = None
        landing = None

        # 1. The likeliest outcome needs no early-exit signal: start it now.
        early = None
        if g and plan.early and drafting:
            early = drafter.submit(Job([committed + drafts], longest + 1, q_params, "early", True,
                                       early_stop, pending, confidence, committed,
                                       longest_copy=None if copies is None else copies + 1))
            pending = []

        picks, late = [], None
        t_start = time.perf_counter()
        split_pass = bool(g and plan.branches and drafting)
        if split_pass:
            # 2. Target prefix, then the early exit's top-kappa at every window position.
            if vocab is None and config.exit_vocab is not None:
                vocab = config.exit_vocab.with_tokens(model, committed)
            p = split.start(model, mx.array([committed[-1:] + drafts]), cache, taps)
            split.run_layers(model, p, 0, exit_layer)
            tapped = list(p.features)  # the window's features at the exit, for the branches
            exit_ids, exit_logp = split.exit_top_k(model, p.h[0], config.exit_head, vocab,
                                                   config.kappa)
            mx.async_eval(exit_ids, exit_logp, *tapped)
            if drafter.inline:
                # The draft runs on this thread next: queue the suffix behind the prefix
                # first, so the target never waits for the draft (nor the draft for it).
                split.run_layers(model, p, exit_layer, n_layers)
                logits = split.final_logits(model, p.h[0])
                mx.async_eval(logits)
                landing = Landing([[exit_ids, exit_logp], [logits]])
                verdict = Verdict(partial(judge, logits, drafts, q, sampler, accept), landing)
                early_stop.verdict = verdict
            drafter.run_pending()  # inline: the early rollout, beside the prefix
            mx.eval(exit_ids, exit_logp, *tapped)
            t_suffix = time.perf_counter()
            seen = []
            if taps and len(tapped) == len(taps):
                seen = [Features.of(committed + drafts, len(committed) - 1, tapped)]

            # 3. The other likely outcomes, rolled out beside the target's suffix.
            picks = rank_branches(
                drafts, np.array(exit_ids), np.array(exit_logp), window.top_ids[:g],
                window.top_probs[:g], plan.branches, config.source)
            outcomes = {(b.r, b.token) for b in picks}
            late_stop = Stop(outcomes.__contains__, early_stop.verdict)
            late = drafter.submit(Job([committed + drafts[: b.r] + [b.token] for b in picks],
                                      longest, q_params, "branches", False, late_stop,
                                      pending + seen, confidence, committed,
                                      longest_copy=copies))
            pending = []

            # 4. Target suffix and verification.
            if not drafter.inline:
                split.run_layers(model, p, exit_layer, n_layers)
                logits = split.final_logits(model, p.h[0])
                mx.async_eval(logits)
                verdict = Verdict(partial(judge, logits, drafts, q, sampler, accept), None)
            feats = p.features
        else:
            # 4. The whole target forward, unsplit: nothing waits for an exit readout.
            t_suffix = t_start
            verified = ahead or Window.verify(model, cache, committed[-1], drafts, q, taps)
            logits, feats = verified.logits, verified.features
            if drafter.inline and early is not None:
                landing = Landing([[logits]])
            verdict = Verdict(partial(judge, logits, drafts, q, sampler, accept), landing)
            early_stop.verdict = verdict if landing else None
        drafter.run_pending()
        accepted, token = verdict.result()
        for c in cache:
            c.trim(g - accepted)
        if taps:
            pending.append(Features.of(committed + drafts[:accepted] + [token],
                                       len(committed) - 1, feats, accepted + 1))
        t_done = time.perf_counter()
        if landing is not None:
            # The target's own spans, not the inline draft's time on this thread.
            times = landing.join()
            t_suffix = (times[0] or t_suffix) if split_pass else t_suffix
            t_done = times[-1] or t_done
        if split_pass:
            # Positions 0..A saw committed context: there the early exit's guess can be scored.
            guessed = np.array(exit_ids[: accepted + 1])
            truth = np.array(drafts[:accepted] + [token])[:, None]
            stats.exit_positions += accepted + 1
            stats.exit_covered += int((guessed == truth).any(axis=1).sum())
            stats.add_time("target_prefix", t_suffix - t_start)
            mark("target_prefix", t_start, t_suffix)
        stats.add_time("target_suffix" if split_pass else "target", t_done - t_suffix)
        if length:
            if ahead is None:  # a window dispatched ahead computed partly while the caller worked
                length.record_target(t_done - t_start, g)
            elif g:  # a copy dispatched ahead: priced from its dispatch (as in speculative.py)
                length.record_target(t_done - ahead.dispatched, g)
            stats.draft_lengths[g] = stats.draft_lengths.get(g, 0) + 1
            if copied:
                length.record_copy(sampler.params.temperature, g, accepted)
        mark("target_suffix" if split_pass else "target", t_suffix, t_done)

        # 5. Reuse a rollout of the actual outcome, or fall back to drafting afresh.
        window = None
        if early is not None:
            hit = next((i for i, b in enumerate(picks) if (b.r, b.token) == (accepted, token)),
                       None)
            for stop in filter(None, (early_stop, late_stop)):
                stop.settle(accepted, token)
            wait = time.perf_counter()
            early_done = early.result(DRAFT_WAIT_S)
            late_done = late.result(DRAFT_WAIT_S) if late is not None else None
            outcome = "fallback"
            if accepted == g and early_done.rollouts[0].tokens[:1] == [token]:
                window, outcome = _tail(early_done.rollouts[0], 1), "early"
            elif hit is not None:
                window, outcome = late_done.rollouts[hit], f"branch:{accepted}"
            if window is not None and not window.tokens and not window.ended:
                window, outcome = None, "fallback"  # stopped before it drafted anything
            mark(f"outcome:{outcome}", t_done, t_done)
            spent += time.perf_counter() - wait
            stats.add_time("wait", time.perf_counter() - wait)
            target_span = (t_start, t_done)
            for job in filter(None, (early_done, late_done)):
                busy = (job.start, job.end)
                hidden = _overlap(busy, target_span)
                stats.add_time("draft", busy[1] - busy[0])
                stats.add_time("draft_hidden", hidden)
                mark(f"draft_{job.label}", *busy)
                if length and own_unit and job.forwards and not job.extra.get("lookup"):
                    # On a unit of its own, what drafting costs the step is the part the
                    # target did not hide (on shared cores hidden work slows the target).
                    length.record_draft(busy[1] - busy[0] - hidden, job.forwards)
            if window is not None:
                stats.reuse_steps += 1
            else:
                stats.fallback_steps += 1
        stats.record_step(g, accepted)
        new = drafts[:accepted] + [token]
        if charged is not None:
            scheduler.record(charged[0], charged[1], len(new))
        if length and drafting and asked:
            length.record_step(sampler.params.temperature, len(new), g, spent)
        committed += new
        was_drafting = drafting
        drafting = length is None or length.drafting(sampler.params.temperature)
        if was_drafting and not drafting:
            scheduler.restart()
        # A next step that drafts nothing (at most a free copy from the context, or a window
        # rolled out in this step) has its window now: its forward computes while the caller
        # works, as AR's does.
        ahead = None
        if not drafting:
            drafts, q, copied, _ = take_window(room(), False, copy_room())
            ahead = Window.verify(model, cache, committed[-1], drafts, q, taps, copied)
        yield new
