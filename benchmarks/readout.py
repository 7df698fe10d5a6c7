"""The early-exit readout's share of a target verification step: the exit head, final norm,
output layer and top-kappa over a window, read out over the whole vocabulary and over the
draft's head tokens only (split.ExitVocab), against one whole verification forward.

    python benchmarks/readout.py [--target SPEC] [--draft SPEC] [--gamma 5] [--context 256]
"""

from __future__ import annotations

import argparse

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.bench.contention import median_ms
from mirror_mlx.draft.load import load_draft, load_exit_head
from mirror_mlx.models import split
from mirror_mlx.models.load import load

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--exit-head", default="default")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--kappa", type=int, default=8)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    args = ap.parse_args()

    target = load(args.target)
    model, window = target.model, args.gamma + 1
    head = load_exit_head(args.exit_head, target)
    ids = load_draft(args.draft, target).head_ids
    vocab = split.ExitVocab.of(model, ids)
    cache = make_prompt_cache(model)
    tokens = mx.arange(args.context)[None] % target.vocab_size
    mx.eval(model(tokens, cache=cache))

    def verify() -> None:
        mx.eval(model(tokens[:, :window], cache=cache))
        for c in cache:
            c.trim(window)

    h = mx.random.normal((window, model.args.hidden_size))
    mx.eval(h)
    step = median_ms(verify, 30)
    print(f"target verification forward over {window} tokens: {step:.2f} ms")
    for name, v in (("whole vocabulary", None), (f"draft head ({len(ids)} tokens)", vocab)):
        ms = median_ms(lambda v=v: mx.eval(*split.exit_top_k(model, h, head, v, args.kappa)),
                       30)
        print(f"exit readout, {name}: {ms:.2f} ms = {ms / step:.1%} of the step")


if __name__ == "__main__":
    main()
