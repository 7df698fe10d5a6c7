"""Prefill and decode speed of a target with each BLAS, and the cost of one forward over k new
tokens relative to k = 1 (what makes speculative verification cheap or not).

    python benchmarks/foundation.py [--model SPEC] [--prompt-tokens 128] [--decode-tokens 32]

Each BLAS runs in its own child process (the BLAS is chosen before MLX loads); the two runs are
interleaved `--rounds` times so that machine drift cancels. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(model_spec: str | None, prompt_tokens: int, decode_tokens: int) -> dict:
    import mirror_mlx  # noqa: F401  (BLAS choice happens here)
    from mirror_mlx.models.load import load
    from mirror_mlx.platform import blas_description

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    target = load(model_spec, quiet=True)
    model = target.model
    ids = (target.tokenizer.encode("The history of the river begins in the mountains. " * 64)
           * 4)[:prompt_tokens]

    def prefill():
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(ids)[None], cache=cache))
        return cache

    prefill()  # warm-up
    t = time.perf_counter()
    cache = prefill()
    prefill_tps = prompt_tokens / (time.perf_counter() - t)

    token = ids[-1]
    t = time.perf_counter()
    for _ in range(decode_tokens):
        logits = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
    decode_tps = decode_tokens / (time.perf_counter() - t)

    cost = {}
    for k in (1, 2, 4, 8, 16):
        times = []
        for _ in range(7):
            t = time.perf_counter()
            mx.eval(model(mx.array([ids[:k]]), cache=cache))
            times.append(time.perf_counter() - t)
            for c in cache:
                c.trim(k)
        cost[k] = statistics.median(times)
    return {
        "blas": blas_description(),
        "prefill_tokens_per_s": prefill_tps,
        "decode_tokens_per_s": decode_tps,
        "forward_ms": {k: v * 1e3 for k, v in cost.items()},
        "forward_cost_vs_k1": {k: v / cost[1] for k, v in cost.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench-out/foundation.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.prompt_tokens, args.decode_tokens)))
        return

    runs: dict[str, list[dict]] = {"reference": [], "openblas": []}
    for _ in range(args.rounds):
        for name in runs:
            env = dict(os.environ)
            if name == "reference":
                env["MIRROR_MLX_BLAS"] = "reference"
            else:
                env.pop("MIRROR_MLX_BLAS", None)
            cmd = [sys.executable, __file__, "--child", name,
                   "--prompt-tokens", str(args.prompt_tokens),
                   "--decode-tokens", str(args.decode_tokens)]
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {name}: done", file=sys.stderr)

    def med(name, key, sub=None):
        vals = [r[key][sub] if sub else r[key] for r in runs[name]]
        return statistics.median(vals)

    print(f"{'BLAS':<10} {'prefill tok/s':>14} {'decode tok/s':>13}  "
          "forward cost k=1,2,4,8,16 (x k=1)")
    for name in runs:
        costs = " ".join(f"{med(name, 'forward_cost_vs_k1', str(k)) :.2f}"
                         for k in (1, 2, 4, 8, 16))
        print(f"{name:<10} {med(name, 'prefill_tokens_per_s'):>14.1f} "
              f"{med(name, 'decode_tokens_per_s'):>13.1f}  {costs}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
