"""A long soak: one Engine per mode generates `--generations` times in a row, as a chat that
keeps overflowing its context, greedy and sampled turns in turn, every other one called from a
fresh thread (as a server's handlers call it), every `--cancel-every`-th generation cancelled
from another thread; the process's memory and threads are sampled every `--every`
generations.

    python benchmarks/soak.py OUT [--generations 1000] [--modes ar,sd,mirror] [--every 10]
        [--context 256] [--max-tokens 32] [--cancel-every 5] [--model SPEC] [--draft SPEC]

A chat turn that no longer fits the context (PromptTooLong) drops the oldest turns until it
does; a reply cut by the context ("context") starts a new chat. Writes OUT/soak.json (the
samples, the counts of finish reasons, the verdict; rewritten at each sample, so a soak cut
short keeps what it measured) and OUT/soak.png after each mode (needs matplotlib: pip
install 'mirror-mlx[bench]'). The verdict, per mode: the resident memory at the end is within
TOLERANCE of what it was after the warm-up (`--warmup`, a share of the generations), and the
process's thread count after the warm-up never exceeds it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.api import Engine, Message
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.errors import PromptTooLong
from mirror_mlx.models.load import load

import mlx.core as mx
from procstats import proc_stats

TOPICS = ("octopuses", "owls", "glaciers", "the printing press", "bees", "volcanoes",
          "the Roman roads", "coral reefs", "lighthouses", "the violin", "deserts", "comets")
# Memory the process may gain after the warm-up (allocator arenas settling, MLX's buffer
# cache, bounded by memory.CLEAR_EVERY). A per-generation leak of one KV cache of the default
# model at --context 256 (~12 MB) passes it within a few dozen generations.
TOLERANCE = 0.05


@dataclass
class Sample:
    mode: str
    generation: int
    seconds: float
    rss_mib: float
    threads: int  # the process's (the OS's count where it gives one, else Python's)
    python_threads: int
    mlx_active_mib: float
    mlx_cache_mib: float


class Canceller:
    """One thread, for the whole soak, that sets a generation's cancel event after a delay."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="canceller", daemon=True)
        self._thread.start()

    def after(self, seconds: float, event: threading.Event) -> None:
        self._jobs.put((seconds, event))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            seconds, event = job
            time.sleep(seconds)
            event.set()


def steady_threads() -> int:
    """The process's threads, less any still ending (a caller's thread just joined): the
    fewest of a few counts 20 ms apart; a leaked thread stays in all of them."""
    counts = []
    for _ in range(5):
        counts.append(proc_stats(os.getpid()).threads or threading.active_count())
        time.sleep(0.02)
    return min(counts)


def sample(mode: str, generation: int, start: float) -> Sample:
    stats = proc_stats(os.getpid())
    return Sample(mode, generation, round(time.monotonic() - start, 1), stats.rss_mib,
                  steady_threads(), threading.active_count(),
                  round(mx.get_active_memory() / 2**20, 1), round(mx.get_cache_memory() / 2**20, 1))


def turn(engine: Engine, messages: list[Message], max_tokens: int, sampling: SamplingParams,
         cancel: threading.Event, finishes: Counter):
    """One chat turn; the oldest turns are dropped while the chat does not fit."""
    while True:
        try:
            return engine.chat(messages, max_tokens=max_tokens, sampling=sampling,
                               cancel=cancel)
        except PromptTooLong:
            finishes["too long: turns dropped"] += 1
            del messages[:2]  # the oldest question and its reply


def on_a_thread(fresh: bool, fn, *args):
    """fn(*args) here, or on a new thread as a server's request handler would call it."""
    if not fresh:
        return fn(*args)
    box = {}
    thread = threading.Thread(target=lambda: box.update(value=fn(*args)))
    thread.start()
    thread.join()
    if "value" not in box:
        raise RuntimeError("the generation on its own thread failed (its traceback is above)")
    return box["value"]


def soak(target, mode: str, args, canceller: Canceller,
         progress: Callable[[list[Sample], Counter], None]) -> tuple[list[Sample], Counter]:
    """`progress(samples, finishes)` after each sample, so an interrupted soak keeps what it
    measured."""
    rng = random.Random(args.seed)
    samples, finishes = [], Counter()
    start = time.monotonic()
    with Engine(target, mode=mode, draft=args.draft, context=args.context, quiet=True) as engine:
        samples.append(sample(mode, 0, start))
        messages: list[Message] = []
        for g in range(1, args.generations + 1):
            messages.append({"role": "user", "content": f"Tell me about {TOPICS[g % 12]}."})
            sampling = SamplingParams() if g % 2 else SamplingParams(temperature=0.8, seed=g)
            cancel = threading.Event()
            if g % args.cancel_every == 0:
                canceller.after(rng.uniform(0.0, 0.3), cancel)  # queued, prefill or decoding
            result = on_a_thread(g % 2 == 0, turn, engine, messages, args.max_tokens,
                                 sampling, cancel, finishes)
            finishes[result.stats.finish_reason] += 1
            if result.stats.finish_reason == "context":
                messages.clear()  # a new chat
            else:
                messages.append(result.message)
            if g % args.every == 0 or g == args.generations:
                samples.append(sample(mode, g, start))
                last = samples[-1]
                print(f"[{mode}] {g}: {last.rss_mib:.0f} MiB, {last.threads} threads",
                      file=sys.stderr, flush=True)
                progress(samples, finishes)
    return samples, finishes


def verdict(samples: list[Sample], warmup: int) -> dict:
    """Growth from the first sample at or after generation `warmup` to the end."""
    after = [s for s in samples if s.generation >= warmup] or samples[-1:]
    base, end = after[0], after[-1]
    growth = (end.rss_mib - base.rss_mib) / base.rss_mib
    peak = max(s.rss_mib for s in after)
    threads = sorted({s.threads for s in after})
    return {"warmup_generation": base.generation, "rss_after_warmup_mib": base.rss_mib,
            "rss_end_mib": end.rss_mib, "rss_peak_mib": peak, "growth": round(growth, 4),
            "threads": threads, "tolerance": TOLERANCE,
            "ok": growth < TOLERANCE and max(threads) <= base.threads}


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, thr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for mode in dict.fromkeys(s.mode for s in samples):
        mine = [s for s in samples if s.mode == mode]
        x = [s.generation for s in mine]
        mem.plot(x, [s.rss_mib for s in mine], marker=".", label=f"{mode}: resident")
        mem.plot(x, [s.mlx_active_mib for s in mine], linestyle="--", label=f"{mode}: MLX active")
        thr.plot(x, [s.threads for s in mine], marker=".", label=mode)
    mem.set_ylabel("MiB")
    mem.legend(fontsize=8)
    mem.set_title("Memory and threads over a soak (one engine per mode)")
    thr.set_ylabel("threads")
    thr.set_xlabel("generation")
    thr.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--generations", type=int, default=1000, help="per mode")
    ap.add_argument("--modes", default="ar,sd,mirror")
    ap.add_argument("--every", type=int, default=10, help="generations between samples")
    ap.add_argument("--warmup", type=float, default=0.1,
                    help="the share of the generations before memory must hold flat")
    ap.add_argument("--context", type=int, default=256, help="small: chats overflow it often")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cancel-every", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    target = load(args.model, quiet=True)
    canceller = Canceller()  # before the first sample: its thread is there throughout
    samples, finishes, verdicts = [], {}, {}

    def write(now: list[Sample], draw: bool) -> None:
        """soak.json with what has been measured so far (and the plot, where `draw`)."""
        (args.out / "soak.json").write_text(json.dumps(
            {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
             "verdicts": verdicts, "finishes": {m: dict(c) for m, c in finishes.items()},
             "samples": [asdict(s) for s in now]}, indent=1))
        if draw and not args.no_plot:
            plot(now, args.out / "soak.png")

    try:
        for mode in (m.strip() for m in args.modes.split(",")):
            def progress(mine: list[Sample], counts: Counter, mode: str = mode) -> None:
                finishes[mode] = counts
                write(samples + mine, draw=False)
            mine, finishes[mode] = soak(target, mode, args, canceller, progress)
            samples.extend(mine)
            verdicts[mode] = verdict(mine, round(args.generations * args.warmup))
            write(samples, draw=True)
    finally:
        canceller.close()
    for mode, v in verdicts.items():
        print(f"{mode}: {args.generations} generations {dict(finishes[mode])}; resident "
              f"{v['rss_after_warmup_mib']:.0f} MiB after warm-up (generation "
              f"{v['warmup_generation']}) -> {v['rss_end_mib']:.0f} MiB at the end "
              f"({v['growth']:+.1%}, peak {v['rss_peak_mib']:.0f}); threads {v['threads']}: "
              f"{'ok' if v['ok'] else 'FAILED'}")
    return 0 if all(v["ok"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
