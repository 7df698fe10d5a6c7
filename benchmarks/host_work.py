"""The host's bookkeeping per draft job, without any model compute: Mirror-SD's jobs (the early
rollout: one sequence of gamma + 1 tokens; the branches: 8 sequences beside it) run through the
rollout (draft/rollout.py) over a stand-in executor that returns fixed logits at once, for a
draft that reads tokens, one that reads the target's features, and the token draft behind
prompt lookup (draft/lookup.py), as a decoding loop calls them: the context grows by a few
tokens a step and every step's early job compacts the cache. What it prints is the time the
rollout itself takes, which a real draft adds to its forwards on the host.

    python benchmarks/host_work.py [--contexts 256 2048 8192] [--steps 40]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.draft.base import Features, Job, JobResult
from mirror_mlx.draft.lookup import LookupDrafter
from mirror_mlx.draft.rollout import TreeState, run_job

import numpy as np

HEAD = 1024  # the draft head's size: the work on logits does not depend on the context
FEATURE = 64  # the width of the target's feature rows
GAMMA = 5
BRANCHES = 8


class StandInExecutor:
    """The Executor protocol with no network: each forward returns logits drawn beforehand
    (they vary from forward to forward, so the drafts do not repeat one token)."""

    def __init__(self, reads_features: bool):
        self.vocab_size = 32000
        self.head_ids = np.arange(HEAD)
        self.streams = 0
        self.reads_features = reads_features
        self.size = 0
        self.forwards = 0
        self.logits = np.random.default_rng(0).normal(size=(256, 1, HEAD)).astype(np.float32)

    def truncate(self, size: int) -> None:
        self.size = min(self.size, size)

    def gather(self, dst: int, slots: list[int]) -> None:
        self.size = dst + len(slots)

    def forward(self, tokens, positions, mask, rows, features=None) -> np.ndarray:
        self.size += len(tokens)
        self.forwards += 1
        at = 7 * self.forwards % (len(self.logits) - len(rows))
        return self.logits[at : at + len(rows)]


class InlineDrafter:
    """A Drafter that runs each job on the caller's thread over the stand-in executor."""

    def __init__(self, reads_features: bool):
        self.executor = StandInExecutor(reads_features)
        self.vocab_size = self.executor.vocab_size
        self.context = None
        self.head_ids = self.executor.head_ids
        self.compute = "stand-in"
        self.inline = True
        self.feature_layers = (1,) if reads_features else ()
        self.state = TreeState()
        self.rng = np.random.default_rng(0)

    def submit(self, job: Job) -> Future[JobResult]:
        done: Future[JobResult] = Future()
        done.set_result(run_job(job, self.executor, self.state, self.rng))
        return done

    def run_pending(self) -> None:
        pass

    def reseed(self, seed: int | None) -> None:
        pass

    def close(self) -> None:
        pass


def rows(n: int) -> np.ndarray:
    return np.ones((n, FEATURE), np.float32)


def decode(drafter, context: int, steps: int, features: bool) -> tuple[float, float]:
    """Mirror-SD's job pattern over `steps` steps after a prompt of `context` tokens: the
    milliseconds per early job and per branch job (medians)."""
    rng = np.random.default_rng(1)
    committed = rng.integers(300, 32000, context).tolist()  # no n-gram repeats: no copies
    pending = [Features(list(committed), 0, rows(context - 1))] if features else []
    window = drafter.submit(Job([committed], GAMMA, features=pending, committed=committed)
                            ).result().rollouts[0]
    pending = []
    early_ms, branch_ms = [], []
    for step in range(steps):
        drafts = window.tokens[:GAMMA]
        t = time.perf_counter()
        drafter.submit(Job([committed + drafts], GAMMA + 1, label="early", features=pending,
                           committed=committed)).result()
        early_ms.append(time.perf_counter() - t)
        seen = [Features(committed + drafts, len(committed) - 1, rows(GAMMA + 1))] \
            if features else []
        picks = [(r % (GAMMA + 1), 100 + step * BRANCHES + r) for r in range(BRANCHES)]
        branches = [committed + drafts[:r] + [v] for r, v in picks]
        t = time.perf_counter()
        late = drafter.submit(Job(branches, GAMMA, label="branches", compact=False,
                                  features=seen, committed=committed)).result()
        branch_ms.append(time.perf_counter() - t)
        # Two drafts accepted, then the token of branch (2, v): its rollout is the next window.
        hit = 2
        accepted, token = picks[hit]
        new = drafts[:accepted] + [token]
        pending = [Features(committed + new, len(committed) - 1, rows(accepted + 1))] \
            if features else []
        committed += new  # in place, as the decoders do (Job.committed)
        window = late.rollouts[hit]
    return 1e3 * float(np.median(early_ms)), 1e3 * float(np.median(branch_ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    kinds = {
        "token draft": lambda: (InlineDrafter(False), False),
        "feature draft": lambda: (InlineDrafter(True), True),
        "lookup + token draft": lambda: (LookupDrafter(InlineDrafter(False)), False),
    }
    print(f"ms per job (median of {args.steps} steps), stand-in executor, head {HEAD}")
    print(f"{'draft':<22}{'context':>8}{'early':>9}{f'{BRANCHES} branches':>12}")
    for name, make in kinds.items():
        for context in args.contexts:
            drafter, features = make()
            early, branch = decode(drafter, context, args.steps, features)
            print(f"{name:<22}{context:>8}{early:>9.3f}{branch:>12.3f}")


if __name__ == "__main__":
    main()
