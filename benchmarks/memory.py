"""Memory over a long chat: one Engine per mode keeps one conversation going for `--turns`
turns (each turn's prompt holds the whole chat so far, reused from the session's KV cache),
and after each turn records MLX's active memory, its buffer cache (and the most it held
between the turn's steps), the KV cache's own bytes and the process's resident set.

    python benchmarks/memory.py OUT_DIR [--modes ar,sd,mirror] [--turns 30] [--max-tokens 48]
        [--model SPEC] [--draft SPEC]

Writes OUT_DIR/memory.csv (one row per mode and turn; turn 0 is the engine just opened) and
OUT_DIR/memory.png (needs matplotlib: pip install 'mirror-mlx[bench]'), and prints, per mode,
memory at the start, after the warm-up turn and at the end, and the growth from warm-up to end.

The KV cache grows with the chat by design (every token stays); what should not grow is the
rest: "other" = active - KV, and MLX's buffer cache of freed blocks.

On Metal MLX lets its buffer cache grow up to its memory limit (1.5x the recommended working
set); MLX's CPU backend caps it at 32 MiB. `--cache-limit metal` (the default) gives any backend
Metal's rule, so that a Linux run shows what a Mac's cache would do; `backend` keeps its own.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.api import Engine
from mirror_mlx.models.load import load

import mlx.core as mx

TOPICS = ("octopuses", "owls", "glaciers", "the printing press", "bees", "volcanoes",
          "the Roman roads", "coral reefs", "lighthouses", "the violin", "deserts", "comets")
FIELDS = ("mode", "turn", "context_tokens", "generated_tokens", "seconds", "active_mb",
          "cache_mb", "cache_max_mb", "kv_mb", "other_mb", "peak_mb", "rss_mb")
MB = 1e6
TITLES = {"other_mb": "other (active - KV cache)", "cache_mb": "cache after the turn",
          "cache_max_mb": "cache, most between steps", "kv_mb": "target's KV cache"}


def rss_bytes() -> int:
    """The process's resident set now (ps reads it the same way on Linux and macOS)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip()) * 1024


def sample(engine: Engine, mode: str, turn: int, context: int, generated: int,
           seconds: float, cache_max: int) -> dict:
    active, cache = mx.get_active_memory(), mx.get_cache_memory()
    kv = sum(c.nbytes for c in engine.session.cache if c.keys is not None)
    return {"mode": mode, "turn": turn, "context_tokens": context,
            "generated_tokens": generated, "seconds": round(seconds, 2),
            "active_mb": round(active / MB, 2), "cache_mb": round(cache / MB, 2),
            "kv_mb": round(kv / MB, 2), "other_mb": round((active - kv) / MB, 2),
            "peak_mb": round(mx.get_peak_memory() / MB, 2), "rss_mb": round(rss_bytes() / MB, 2),
            "cache_max_mb": round(cache_max / MB, 2)}


def chat(target, mode: str, turns: int, max_tokens: int, draft: str | None) -> list[dict]:
    # Each mode starts from the same empty buffer cache, whatever the mode before it left.
    mx.clear_cache()
    mx.reset_peak_memory()
    rows = []
    with Engine(target, mode=mode, draft=draft) as engine:
        rows.append(sample(engine, mode, 0, 0, 0, 0.0, mx.get_cache_memory()))
        messages, generated = [], 0
        for turn in range(1, turns + 1):
            topic = TOPICS[(turn - 1) % len(TOPICS)]
            messages.append({"role": "user", "content": f"Tell me about {topic}."})
            start = time.perf_counter()
            text, largest = [], 0
            for chunk in engine.stream(messages, max_tokens=max_tokens):
                text.append(chunk.text)
                largest = max(largest, mx.get_cache_memory())  # between steps
                stats = chunk.stats  # the last chunk carries them
            seconds = time.perf_counter() - start
            messages.append({"role": "assistant", "content": "".join(text)})
            generated += stats.generated_tokens
            context = stats.prompt_tokens + stats.generated_tokens
            rows.append(sample(engine, mode, turn, context, generated, seconds, largest))
            print(f"{mode} turn {turn}: {context} tokens in context, "
                  f"active {rows[-1]['active_mb']} MB, cache {rows[-1]['cache_mb']} MB, "
                  f"rss {rows[-1]['rss_mb']} MB ({seconds:.1f} s)", file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per mode and measure: at the start, after the first (warm-up) turn, at the end, and
    the growth from warm-up to end."""
    lines = ["| mode | measure | start MB | after warm-up MB | end MB | growth |",
             "|---|---|---:|---:|---:|---:|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        start, warm, end = mine[0], mine[min(1, len(mine) - 1)], mine[-1]
        for key in ("active_mb", "kv_mb", "other_mb", "cache_mb", "cache_max_mb", "rss_mb"):
            growth = (f"{100 * (end[key] - warm[key]) / warm[key]:+.0f}%" if warm[key] > 0
                      else f"{end[key] - warm[key]:+.1f} MB")
            lines.append(f"| {mode} | {key[:-3]} | {start[key]} | {warm[key]} | {end[key]} | "
                         f"{growth} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    keys = ("active_mb", "other_mb", "cache_mb", "cache_max_mb", "kv_mb", "rss_mb")
    fig = Figure(figsize=(14, 7))
    for i, key in enumerate(keys):
        ax = fig.add_subplot(2, 3, i + 1)
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([r["turn"] for r in mine], [r[key] for r in mine], marker=".", label=mode)
        ax.set_title(TITLES.get(key, key[:-3]))
        ax.set_xlabel("turn")
        ax.set_ylabel("MB")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Memory over a long chat (MLX {mx.__version__}, {mx.default_device()})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for memory.csv and memory.png")
    parser.add_argument("--modes", default="ar,sd,mirror")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="target spec (default: the default model)")
    parser.add_argument("--draft", default=None, help="draft spec (default: the default draft)")
    parser.add_argument("--cache-limit", choices=("metal", "backend"), default="metal",
                        help="MLX's buffer cache limit: Metal's (the memory limit) or the "
                        "backend's own")
    args = parser.parse_args()
    if args.cache_limit == "metal":
        mx.set_cache_limit(mx.get_memory_limit())
    args.out.mkdir(parents=True, exist_ok=True)
    target = load(args.model, quiet=True)
    rows = []
    for mode in args.modes.split(","):
        rows += chat(target, mode, args.turns, args.max_tokens, args.draft)
    with open(args.out / "memory.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print("\n".join(summary(rows)))
    try:
        plot(rows, args.out / "memory.png")
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'mirror-mlx[bench]')",
              file=sys.stderr)


if __name__ == "__main__":
    main()
