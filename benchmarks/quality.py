"""The draft and exit-head quality bars, measured on a prompt set (Spec-Bench format JSONL):

- vanilla SD at gamma = 5: tokens per target step, with prompt lookup (the default) and with
  the draft network alone (sd-network);
- early-exit top-kappa coverage at the exit layer, scored during Mirror-SD decoding;
- Mirror-SD fallback rate;
- draft cost per token relative to the target's (one-token forwards, medians);
- tokens/s of AR, SD and Mirror-SD in one run, interleaved prompt by prompt.

    python benchmarks/quality.py --prompts PATH/question.jsonl --per-category 2 \
        [--max-tokens 128] [--draft SPEC] [--out bench-out/quality.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.api import Engine
from mirror_mlx.draft.base import Job
from mirror_mlx.models.load import load
from mirror_mlx.platform import machine_info

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def first_turns(path: Path, per_category: int) -> list[tuple[str, str]]:
    kept, seen = [], defaultdict(int)
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if seen[q["category"]] < per_category:
            seen[q["category"]] += 1
            kept.append((q["category"], q["turns"][0]))
    return kept


def draft_cost_ratio(target, engine: Engine, repeats: int = 20) -> dict:
    """Median one-token forward of the draft network (through its own job path; `engine`
    drafts without lookup, which would copy this repetitive text for free) and of the target."""
    ids = target.tokenizer.encode("The history of the river begins in the mountains. " * 8)
    cache = make_prompt_cache(target.model)
    mx.eval(target.model(mx.array([ids[:-1]]), cache=cache))
    t_times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(target.model(mx.array([[ids[-1]]]), cache=cache))
        t_times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(1)
    d_times = []
    drafter = engine.drafter
    drafter.submit(Job([ids], 0)).result()
    for _ in range(repeats):
        r = drafter.submit(Job([ids], 8)).result()
        d_times.append((r.end - r.start) / 8)
    t_ms, d_ms = statistics.median(t_times) * 1e3, statistics.median(d_times) * 1e3
    return {"target_ms_per_token": t_ms, "draft_ms_per_token": d_ms, "ratio": d_ms / t_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench-out/quality.json"))
    args = ap.parse_args()

    target = load(None)
    engines = {"ar": Engine(target, mode="ar"),
               "sd": Engine(target, mode="sd", draft=args.draft, gamma=args.gamma),
               "sd-network": Engine(target, mode="sd", draft=args.draft, gamma=args.gamma,
                                    lookup=False),
               "mirror": Engine(target, mode="mirror", draft=args.draft, gamma=args.gamma)}
    prompts = first_turns(args.prompts, args.per_category)
    rows = []
    engines["ar"].generate("Warm up.", max_tokens=8)
    for i, (category, text) in enumerate(prompts):
        for mode, engine in engines.items():
            engine.session.reset()
            s = engine.generate(text, max_tokens=args.max_tokens).stats
            rows.append({"category": category, "mode": mode, **s.to_dict()})
        print(f"[{i + 1}/{len(prompts)}] {category}", flush=True)

    def total(mode, key):
        return sum(r[key] for r in rows if r["mode"] == mode)

    summary = {}
    for mode in engines:
        gen, steps = total(mode, "generated_tokens"), total(mode, "target_steps")
        committed = total(mode, "committed_tokens")
        summary[mode] = {
            "tokens_per_second": gen / total(mode, "decode_s"),
            "tokens_per_target_step": committed / max(steps, 1),
            "fallback_rate": total(mode, "fallback_steps") / max(
                total(mode, "fallback_steps") + total(mode, "reuse_steps"), 1),
            "exit_coverage": total(mode, "exit_covered") / max(total(mode, "exit_positions"), 1),
        }
    for mode in ("sd", "sd-network", "mirror"):
        summary[mode]["speedup_vs_ar"] = (summary[mode]["tokens_per_second"]
                                          / summary["ar"]["tokens_per_second"])
    summary["draft_cost"] = draft_cost_ratio(target, engines["sd-network"])
    result = {"machine": machine_info().__dict__, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
