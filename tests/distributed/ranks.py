"""Run on every rank (by mlx.launch) in the distributed tests: the default decoders over the
target split over the ranks (`--parallel`, pipeline unless told); rank 0 prints one JSON
line {mode: {"token_ids", "stats"}}.
`--other-model` loads another file on rank 1; `--die-after N` kills rank 1 as it gets its
Nth forward, `--hang-after N` makes it stop answering there."""

import argparse
import json
import os
import signal
import sys
import time

import mirror_mlx  # noqa: F401  (first: makes MLX use OpenBLAS where installed)
from mirror_mlx.api import Engine
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.distributed import stage
from mirror_mlx.distributed.run import Options, pipelined, want_layers
from mirror_mlx.errors import MirrorError


def interleave(target, prompt: str) -> dict:
    """Two sessions in turn over the ranks, the first continued after the second ran: the
    other ranks keep a cache for each."""
    with Engine(target, quiet=True, mode="ar") as first, \
            Engine(target, quiet=True, mode="ar") as second:
        a = first.generate(prompt, max_tokens=4).token_ids
        b = second.generate("Write one word.", max_tokens=4).token_ids
        again = first.generate(prompt, max_tokens=4)
    return {"first": a, "second": b, "again": again.token_ids,
            "cached": again.stats.cached_prompt_tokens}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--other-model", default=None)
    p.add_argument("--split", default=None)
    p.add_argument("--parallel", default="pipeline")
    p.add_argument("--modes", default="ar,sd,mirror")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--branch-budget", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="Name three colors.")
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--hang-after", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--sampled", action="store_true", help="then SD at temperature 0.8, seed 3")
    p.add_argument("--interleave", action="store_true",
                   help="then continue one session after another one ran")
    args = p.parse_args()
    rank = int(os.environ["MLX_RANK"])
    model = args.other_model if rank == 1 and args.other_model else args.model
    if rank == 1 and (args.die_after or args.hang_after):
        run_stage, calls = stage.run_stage, []

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if len(calls) == args.hang_after:
                time.sleep(3600)  # alive, connected, silent
            return run_stage(*a, **k)

        stage.run_stage = failing
    try:
        with pipelined(model, "float32", Options(args.parallel, args.split, args.timeout),
                       quiet=True) as (target, pipeline):
            out = {}
            for mode in args.modes.split(","):
                with Engine(target, mode=mode, gamma=args.gamma, quiet=True,
                            branch_budget=args.branch_budget) as engine:
                    want_layers(pipeline, engine)
                    r = engine.generate(args.prompt, max_tokens=args.max_tokens)
                    out[mode] = {"token_ids": r.token_ids, "stats": r.stats.to_dict()}
            if args.sampled:  # rank 0 samples; with a fixed window the draws fall alike
                with Engine(target, mode="sd", gamma=args.gamma, quiet=True) as engine:
                    want_layers(pipeline, engine)
                    r = engine.generate(args.prompt, max_tokens=args.max_tokens,
                                        sampling=SamplingParams(temperature=0.8, seed=3))
                    out["sd-sampled"] = {"token_ids": r.token_ids}
            if args.interleave:
                out["interleaved"] = interleave(target, args.prompt)
            out["early_exits"] = getattr(pipeline, "early_exits", 0)
            print(json.dumps(out), flush=True)
    except MirrorError as e:
        print(f"mirror-mlx: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
