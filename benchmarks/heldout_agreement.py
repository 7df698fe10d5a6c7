"""Held-out first-token agreement of several drafts on one distill data folder: how often each
draft's best token is the target's best token, over the records `distill` held out of training
(the same split: the folder's records, shuffled with the training seed, the first `--holdout`
share). So a draft trained on the folder and drafts trained elsewhere are scored on the same
replies they never saw. Drafts that read the target's features are scored on their first pass.

    python benchmarks/heldout_agreement.py --data WORK/data --drafts default,FOLDER,...
        [--seed 0] [--holdout 0.02] [--seq-len 384] [--shards N] [--unseen-after N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.draft.load import load_draft
from mirror_mlx.models.load import load
from mirror_mlx.train import feature
from mirror_mlx.train.data import load_data, shard_paths
from mirror_mlx.train.distill import _batches, agreement, examples, features_of, head_positions

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path, help="a distill work folder's data/")
    p.add_argument("--drafts", required=True, help="comma-separated draft specs")
    p.add_argument("--seed", type=int, default=0, help="the seed the training run used")
    p.add_argument("--holdout", type=float, default=0.02)
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--shards", type=int, default=None,
                   help="the first N shards only: those the run trained on, where the folder "
                        "has grown since (distill --conversations N: N / 128 shards)")
    p.add_argument("--unseen-after", type=int, default=0,
                   help="score only the held-out records past the folder's first N: where a "
                        "draft compared here was trained on those (distill --conversations N)")
    args = p.parse_args()
    target = load("default")
    items = examples(load_data(shard_paths(args.data)[: args.shards]), args.seq_len)
    order = list(range(len(items)))
    np.random.default_rng(args.seed).shuffle(order)  # as train_draft shuffles its items
    held = [items[i] for i in order[: max(1, int(len(items) * args.holdout))]
            if i >= args.unseen_after]
    unscored = sum(not e.scored for e in held)
    held = [e for e in held if e.scored]
    print(f"{len(held)} held-out records of {len(items)} in {args.data}"
          + (f" ({unscored} more are sampled replies labelled by their own tokens: not scored)"
             if unscored else ""))
    for spec in args.drafts.split(","):
        net = load_draft(spec, target)
        index = head_positions(list(net.config.head_tokens or range(target.vocab_size)),
                               target.vocab_size)
        if net.reads_features:
            feats = features_of(target, held, net.config.feature_layers)
            batches = _batches(held, 1, args.seq_len, index, np.random.default_rng(0), feats)
            score = feature.feature_agreement(net, batches, 1)
        else:
            score = agreement(net, held, index, args.seq_len)
        print(f"{spec}: first-token agreement {100 * score['top1_agreement']:.1f}% over "
              f"{score['positions']} positions")


if __name__ == "__main__":
    main()
