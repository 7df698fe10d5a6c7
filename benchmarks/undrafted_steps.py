"""What a step that does not draft costs in SD and Mirror-SD, against an AR step.

Where drafting does not pay (a hot temperature, text unlike what the draft learnt) the draft
gate (decode/length.py) stops drafting, and such steps should cost what target-only decoding
costs. Here drafting is held off for the whole run (the gate is set paused at the run's
temperature), so every SD and Mirror-SD step is such a step; the three modes decode the same
prompts, interleaved prompt by prompt, and each prints its milliseconds per decoded token and
its ratio to AR's. Prompt lookup stays on, as in use (a copy from the context is still
tried), unless --no-lookup: then every step is a one-token step, the same work as AR's.

    python benchmarks/undrafted_steps.py [--prompts builtin|FILE.jsonl] [--per-category 1]
        [--count 4] [--temp 1.0] [--max-tokens 64] [--repeats 2] [--no-lookup]
"""

from __future__ import annotations

import argparse

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.api import Engine
from mirror_mlx.bench.prompts import load_prompts
from mirror_mlx.decode.length import Gate
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.models.load import load

MODES = ("ar", "sd", "mirror")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="builtin")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--count", type=int, default=4, help="prompts used (first turns)")
    p.add_argument("--temp", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="the first is a warm-up, not counted")
    p.add_argument("--no-lookup", action="store_true", help="no copies from the context either")
    args = p.parse_args()
    prompts = [q.turns[0] for q in load_prompts(args.prompts, args.per_category)][: args.count]
    target = load(None)
    engines = {m: Engine(target, mode=m, lookup=not args.no_lookup, quiet=True) for m in MODES}
    for mode in MODES[1:]:
        engines[mode].session.length.gates[round(args.temp, 2)] = Gate(off_for=10**9)
    seconds = dict.fromkeys(MODES, 0.0)
    tokens = dict.fromkeys(MODES, 0)
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for mode, engine in engines.items():
                engine.session.reset()
                stats = engine.generate(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(
                    temperature=args.temp, seed=i)).stats
                if repeat:
                    seconds[mode] += stats.decode_s
                    tokens[mode] += stats.generated_tokens - 1
    ar = seconds["ar"] / tokens["ar"]
    for mode in MODES:
        per = seconds[mode] / tokens[mode]
        print(f"{mode:6s} {1e3 * per:6.2f} ms per token over {tokens[mode]} tokens; "
              f"x AR {ar / per:.3f}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
