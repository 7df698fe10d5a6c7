"""Sampled speculative decoding's acceptance for a draft, per category, from a bench run's AR
replies at its temperature: what bounds SD's speed there, in minutes instead of a timed run.

A drafted token x ~ q is accepted with probability min(1, p(x) / q(x)), so the chance that a
window's i-th token is accepted is sum_x min(p, q) (p: the target's distribution, q: the draft's,
both after the temperature). Teacher forcing the target and the draft over each prompt + AR
reply gives it at every reply position, for the i-th token of a window as acceptance.py does
(a draft that reads the target's features drafts later tokens from its own). Approximate in one
respect: an accepted token is drawn from min(p, q) rather than p, so the context a window sees
after its first token is not exactly the reply's. Tokens per drafting step at gamma g: 1 + the
sum over k <= g of the chance that tokens 1..k are all accepted, averaged over positions.

`--draft-temps`: q after the sampling temperature times each factor instead (verification stays
exact for any q; a draft sharper or flatter than the target may overlap it more).

    python benchmarks/sampled_acceptance.py --bench OUT/bench.json \
        --prompts PATH/question.jsonl [--draft SPEC] [--gamma 3] [--draft-temps 1.0,0.9]
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
from mirror_mlx.draft.load import load_draft
from mirror_mlx.models.load import load
from mirror_mlx.train import feature

import mlx.core as mx
import numpy as np


def overlaps(target, net, prompt: list[int], reply: list[int], temperature: float,
             factors: list[float], gamma: int) -> np.ndarray:
    """(len(factors), gamma, len(reply)): sum_x min(p, q) for reply[t] as a window's i-th
    token, q at temperature * factor."""
    ids = prompt + reply[:-1]
    start = len(prompt) - 1
    logits = target.model(mx.array([ids]))[0, start:].astype(mx.float32)
    # The target's probabilities of the draft's head tokens: q is zero elsewhere.
    p = mx.softmax(logits / temperature, axis=-1)[:, mx.array(np.array(net.head_ids))]
    passes = feature.passes_over_text(target, net, ids, gamma)
    return np.array([[mx.sum(mx.minimum(p, mx.softmax(d[0, start:].astype(mx.float32)
                                                      / (temperature * factor), axis=-1)),
                             axis=-1) for d in passes] for factor in factors])


def tokens_per_step(alpha: np.ndarray) -> float:
    """Expected tokens a drafting step commits, summed over its positions: alpha (gamma, T).
    A step at t commits its accepted drafts and the target's token, at most the n - t tokens
    the reply has left (as acceptance.py counts)."""
    gamma, n = alpha.shape
    total = 0.0
    for t in range(n):
        survive = 1.0
        total += 1.0
        for i in range(min(gamma, n - t - 1)):
            survive *= alpha[i, t + i]
            total += survive
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, type=Path,
                    help="a bench.json with an ar mode run at a temperature above 0")
    ap.add_argument("--prompts", required=True, help="the prompt file that bench ran")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--draft-temps", default="1.0",
                    help="comma-separated factors on the sampling temperature for q")
    args = ap.parse_args()

    doc = json.loads(args.bench.read_text())
    temperature = doc["config"]["temperature"]
    if not temperature:
        raise SystemExit(f"{args.bench}: greedy; benchmarks/acceptance.py measures that exactly")
    if not any(r["mode"] == "ar" for r in doc["runs"]):
        raise SystemExit(f"{args.bench}: no ar runs")
    factors = [float(x) for x in args.draft_temps.split(",")]
    target = load(doc["target"]["spec"] if doc["target"]["spec"] != "default" else None)
    net = load_draft(args.draft, target)
    encoder = Engine(target, mode="ar")
    # per category and factor: positions, first-token acceptance summed, tokens a step summed
    totals = defaultdict(lambda: np.zeros((len(factors), 3)))
    for category, prompt, reply in ar_turns(doc["runs"], load_prompts(args.prompts), encoder):
        alpha = overlaps(target, net, prompt, reply, temperature, factors, args.gamma)
        rows = np.array([[len(reply), a[0].sum(), tokens_per_step(a)] for a in alpha])
        totals[category] += rows
        totals["all"] += rows
    print(f"temperature {temperature}, gamma {args.gamma}: the first drafted token's acceptance "
          f"and tokens per drafting step, by draft temperature factor")
    print(f"{'category':16} " + " ".join(f"{f'x{f:g}':>14}" for f in factors))
    for cat, rows in sorted(totals.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        print(f"{cat:16} " + " ".join(f"{a / n:6.1%} / {s / n:5.2f}" for n, a, s in rows))
    encoder.close()


if __name__ == "__main__":
    main()
