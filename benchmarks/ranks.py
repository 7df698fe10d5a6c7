"""Decoding speed with the target in one process and split over ranks on this machine (ring
backend on loopback), tensor and pipeline parallel, side by side: each prints every mode's
decode tokens per second, and whether its greedy tokens are one process's AR tokens.

Ranks that share a machine share its cores (each gets an equal share of BLAS threads), so on
a small machine this measures what splitting costs, not what it gains: across machines each
rank has cores (and memory bandwidth) of its own.

    python benchmarks/ranks.py [--ranks 3] [--modes ar,sd] [--max-tokens 64]
        [--splits tensor,pipeline] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.api import Engine
from mirror_mlx.distributed.launch import launched, relaunch
from mirror_mlx.distributed.run import Options, pipelined, want_layers
from mirror_mlx.models.load import load


def generate(target, modes: list[str], prompt: str, max_tokens: int, remote=None) -> dict:
    out = {}
    for mode in modes:
        with Engine(target, mode=mode, quiet=True) as engine:
            if remote is not None:
                want_layers(remote, engine)
            engine.generate(prompt, max_tokens=8)  # warm-up
            r = engine.generate(prompt, max_tokens=max_tokens)
            out[mode] = {"token_ids": r.token_ids, "tok_s": r.stats.tokens_per_second,
                         "tokens": r.stats.generated_tokens, "parallel": r.stats.parallel}
    return out


def rank_main(args) -> None:
    with pipelined(None, "auto", Options(args.parallel), quiet=True) as (target, remote):
        out = generate(target, args.modes.split(","), args.prompt, args.max_tokens, remote)
        Path(args.result).write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--modes", default="ar,sd")
    p.add_argument("--splits", default="tensor,pipeline")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="Explain why the sky is blue.")
    p.add_argument("--port", type=int, default=24310)
    p.add_argument("--parallel", default=None, help=argparse.SUPPRESS)  # a rank's own run
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if launched():
        rank_main(args)
        return
    modes = args.modes.split(",")
    print(f"{'':22}" + "".join(f"{m + ' tok/s':>12}" for m in modes)
          + "   same tokens as 1-process AR", flush=True)
    single = generate(load(None), modes, args.prompt, args.max_tokens)
    reference = single["ar"]["token_ids"] if "ar" in single else None

    def row(name: str, results: dict) -> None:
        same = [m for m, r in results.items() if r["token_ids"] == reference]
        print(f"{name:22}" + "".join(f"{r['tok_s']:12.2f}" for r in results.values())
              + f"   {', '.join(same) or 'none'}", flush=True)

    row("1 process", single)
    for parallel in args.splits.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            argv = sys.argv[1:] + ["--parallel", parallel, "--result", str(result)]
            status = relaunch(argv, ",".join(["127.0.0.1"] * args.ranks), None, args.port,
                              (os.path.abspath(__file__),))
            if status:
                raise SystemExit(f"{parallel}: the ranks failed ({status})")
            row(f"{args.ranks} ranks {parallel}", json.loads(result.read_text()))

if __name__ == "__main__":
    main()
