"""Which branches to roll out while the target verifies: the outcomes (A, c) most likely to
happen, under a budget.

A step's outcome is A, the number of drafts the target accepts, and c, the target's own token
after them. Before verification ends two signals exist: the target's early exit (top-kappa ids
and log-probs at each window position) and the draft's own distributions (its top-k at each
drafted position). With a_i the estimated chance that the target accepts draft i + 1,
    P(A = r) = a_0 ... a_{r-1} (1 - a_r)        (r < gamma),   P(A = gamma) = a_0 ... a_{gamma-1}
and the correction c at r < gamma is a token other than the rejected draft, so its estimate is
renormalized without it. A branch's score is P(A = r) * P(c = v | A = r).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SOURCES = ("exit", "draft", "union")


@dataclass(frozen=True)
class Branch:
    r: int  # drafts accepted before the branch's token
    token: int  # the target's token after them, as guessed
    score: float


def _probs(ids: np.ndarray, probs: np.ndarray) -> dict[int, float]:
    return {int(i): float(p) for i, p in zip(ids, probs)}


def rank_branches(drafts: list[int], exit_ids: np.ndarray, exit_logp: np.ndarray,
                  draft_ids: np.ndarray, draft_probs: np.ndarray, budget: int,
                  source: str = "union", exclude: frozenset = frozenset()) -> list[Branch]:
    """The `budget` best branches. `exit_*`: (gamma + 1, kappa) from the early exit at every
    window position; `draft_*`: (gamma, k) the draft's top tokens at each drafted position."""
    if source not in SOURCES:
        raise ValueError(f"branch source must be one of {SOURCES}")
    gamma = len(drafts)
    exit_p = [_probs(exit_ids[r], np.exp(exit_logp[r])) for r in range(gamma + 1)]
    draft_p = [_probs(draft_ids[r], draft_probs[r]) for r in range(min(gamma, len(draft_ids)))]

    def estimate(r: int, token: int) -> float:
        e = exit_p[r].get(token, 0.0)
        d = draft_p[r].get(token, 0.0) if r < len(draft_p) else e
        return {"exit": e, "draft": d, "union": 0.5 * (e + d)}[source]

    accept = [estimate(r, drafts[r]) for r in range(gamma)]
    scored = []
    reach = 1.0  # P(the first r drafts are accepted)
    for r in range(gamma + 1):
        if r < gamma:
            stop = reach * (1.0 - accept[r])
            rejected = drafts[r]
        else:
            stop, rejected = reach, None
        if stop <= 0.0:
            break
        pool = set(exit_p[r]) if source != "draft" else set()
        if source != "exit" and r < len(draft_p):
            pool |= set(draft_p[r])
        pool.discard(rejected)
        mass = 1.0 - (estimate(r, rejected) if rejected is not None else 0.0)
        for token in pool:
            if (r, token) not in exclude:
                scored.append(Branch(r, token, stop * estimate(r, token) / max(mass, 1e-6)))
        if r < gamma:
            reach *= accept[r]
    scored.sort(key=lambda b: -b.score)
    return scored[:budget]
