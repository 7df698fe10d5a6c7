"""Pool several `mirror-mlx bench` runs (their bench.json files): per category and mode, the
speedup over AR of each generation (same question, turn and repeat, within its run), as the
median and the geometric mean with a 95% bootstrap interval. At a temperature above 0 a
category's 3-6 generations per run leave its ratio uncertain by several per cent; pooled runs
say how uncertain.

    python benchmarks/pool_runs.py RUN1/bench.json RUN2/bench.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np


def speedups(paths: list[str]) -> dict[tuple[str, str], list[float]]:
    """{(category or "all", mode): per-generation decode tok/s over AR's}."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            runs = json.load(f)["runs"]
        ar = {(r["question_id"], r["turn"], r["repeat"]): r["decode_tokens_per_second"]
              for r in runs if r["mode"] == "ar"}
        for r in runs:
            if r["mode"] == "ar":
                continue
            x = r["decode_tokens_per_second"] / ar[(r["question_id"], r["turn"], r["repeat"])]
            out[(r["category"], r["mode"])].append(x)
            out[("all", r["mode"])].append(x)
    return out


def table(ratios: dict[tuple[str, str], list[float]], draws: int = 4000) -> str:
    rng = np.random.default_rng(0)
    modes = sorted({m for _, m in ratios})
    lines = ["| category | " + " | ".join(f"{m}: n, median, geometric mean [95%]" for m in modes)
             + " |", "|---|" + "---|" * len(modes)]
    for cat in sorted({c for c, _ in ratios}, key=lambda c: (c == "all", c)):
        cells = []
        for m in modes:
            x = np.log(ratios[(cat, m)])
            means = np.exp(rng.choice(x, (draws, len(x))).mean(axis=1))
            lo, hi = np.percentile(means, [2.5, 97.5])
            cells.append(f"{len(x)}, {np.exp(np.median(x)):.2f}, {np.exp(x.mean()):.2f} "
                         f"[{lo:.2f}-{hi:.2f}]")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="bench.json files")
    print(table(speedups(p.parse_args().runs)))


if __name__ == "__main__":
    main()
