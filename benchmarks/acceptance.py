"""Greedy speculative tokens per target step for a draft, and the exit head's top-kappa
coverage, computed exactly from a bench run's AR outputs in minutes instead of a timed run.

With greedy verification a chained draft's i-th token is accepted iff it equals the target's,
and while its tokens are accepted the draft sees exactly the target's text. So one forward of
the draft over each prompt + AR reply (teacher forcing) gives every step's accepted length:
a step at position t accepts the run of positions t, t+1, ... (at most gamma) where the
draft's argmax equals the reply's token. Prompt lookup is simulated with the engine's own
`lookup`. Exact for drafts without speculative streams. A draft that reads the target's
features drafts its i-th token of a step from its own features after the first: that is pass i
of its training-time test (train/feature.py), run over the same text, so right[i, t] says
whether it gets reply[t] right as the i-th token of a step.

Exit coverage: Mirror-SD scores the early exit at the positions that saw committed context,
which over a generation are all of its positions; so one target forward over prompt + reply,
read out at the exit layer, gives the same share (up to float differences between one long
forward and step-by-step decoding).

    python benchmarks/acceptance.py --bench bench-out/spec-bench/bench.json \
        --prompts PATH/question.jsonl [--draft SPEC] [--exit-head FILE|default] [--gamma 5]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.api import Engine
from mirror_mlx.bench.harness import ar_turns
from mirror_mlx.bench.prompts import load_prompts
from mirror_mlx.draft.load import load_draft, load_exit_head
from mirror_mlx.draft.lookup import lookup
from mirror_mlx.models import split
from mirror_mlx.models.load import load
from mirror_mlx.train import feature

import mlx.core as mx
import numpy as np


def steps(prompt: list[int], reply: list[int], right: np.ndarray, gamma: int,
          use_lookup: bool) -> int:
    """Target steps to commit `reply`; right[i, t]: the draft's guess for reply[t] is right
    when it is the i-th drafted token of a step (the same for every i for a token draft)."""
    context, t, n = list(prompt), 0, 0
    while t < len(reply):
        copy = lookup(context, gamma) if use_lookup else None
        accepted = 0
        if copy is not None:
            while accepted < len(copy) and t + accepted < len(reply) \
                    and copy[accepted] == reply[t + accepted]:
                accepted += 1
        else:
            while accepted < gamma and t + accepted < len(reply) and \
                    right[accepted, t + accepted]:
                accepted += 1
        step = min(accepted + 1, len(reply) - t)
        context += reply[t : t + step]
        t, n = t + step, n + 1
    return n


def correct(target, net, prompt: list[int], reply: list[int], gamma: int) -> np.ndarray:
    """(gamma, len(reply)): whether the draft's argmax is reply[t] as the i-th drafted token."""
    passes = feature.passes_over_text(target, net, prompt + reply[:-1], gamma)
    guesses = [np.array(net.head_ids[mx.argmax(p[0, len(prompt) - 1 :], axis=-1)])
               for p in passes]
    return np.stack(guesses) == np.array(reply)[None]


def exit_hits(target, head, vocabs, ids: list[int], reply: list[int], kappa: int) -> list[int]:
    """Reply positions whose token is in the exit's top-kappa (`ids`: prompt + reply), read
    out over each of `vocabs` (None: the whole vocabulary)."""
    model = target.model
    p = split.start(model, mx.array([ids[:-1]]), [None] * target.num_layers)
    split.run_layers(model, p, 0, head.layer)
    h = p.h[0, len(ids) - len(reply) - 1 :]
    truth = np.array(reply)[:, None]
    return [int((np.array(split.exit_top_k(model, h, head, v, kappa)[0]) == truth)
                .any(axis=1).sum()) for v in vocabs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, type=Path, help="a bench.json with an ar mode")
    ap.add_argument("--prompts", required=True, help="the prompt file that bench ran")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--exit-head", default="default")
    ap.add_argument("--kappa", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=5)
    args = ap.parse_args()

    doc = json.loads(args.bench.read_text())
    if not any(r["mode"] == "ar" for r in doc["runs"]):
        raise SystemExit(f"{args.bench}: no ar runs")
    target = load(doc["target"]["spec"] if doc["target"]["spec"] != "default" else None)
    net = load_draft(args.draft, target)
    head = load_exit_head(args.exit_head, target)
    if head is None:
        raise SystemExit("no exit head: name a file with --exit-head")
    encoder = Engine(target, mode="ar")
    # The exit read out over the whole vocabulary and, as Mirror-SD does, over the draft's
    # head tokens and the prompt's.
    head_vocab = split.ExitVocab.of(target.model, net.head_ids)
    # tokens, steps (network), steps (lookup), exit hits (full), exit hits (reduced)
    totals = defaultdict(lambda: np.zeros(5))
    for category, prompt, reply in ar_turns(doc["runs"], load_prompts(args.prompts), encoder):
        right = correct(target, net, prompt, reply, args.gamma)
        row = [len(reply), steps(prompt, reply, right, args.gamma, False),
               steps(prompt, reply, right, args.gamma, True),
               *exit_hits(target, head, [None, head_vocab.with_tokens(target.model, prompt)],
                          prompt + reply, reply, args.kappa)]
        totals[category] += row
        totals["all"] += row
    print(f"tokens per target step at gamma {args.gamma} (network alone, with lookup); "
          f"exit top-{args.kappa} coverage at layer {head.layer} over the whole vocabulary "
          f"and over the draft's {len(net.head_ids)} head tokens and the prompt's")
    print(f"{'category':16} {'network':>8} {'+lookup':>8} {'exit':>6} {'reduced':>8}")
    for cat, (tokens, net_steps, look_steps, hits, reduced) in sorted(
            totals.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        print(f"{cat:16} {tokens / net_steps:8.2f} {tokens / look_steps:8.2f} "
              f"{hits / tokens:6.1%} {reduced / tokens:8.1%}")
    encoder.close()


if __name__ == "__main__":
    main()
