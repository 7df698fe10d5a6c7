"""Does the draft's compute slow the target down? Times a target verification forward alone and
with the draft running forwards beside it on a thread of its own (its own stream), as the MLX
drafter runs. A ratio near 1 means the two have separate compute; on a CPU-only host whose
cores both use, it shows what each rollout beside the target costs."""

from __future__ import annotations

import statistics
import threading
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..draft.net import DraftNet
from ..models.load import LoadedModel

CONTEXT = 256  # tokens in the caches, as a reply in progress


def median_ms(step, n: int) -> float:
    """Median wall time of `step` over `n` calls, after two untimed ones."""
    step()
    step()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure_contention(target: LoadedModel, net: DraftNet, window: int = 6,
                       n: int = 12, draft_device: mx.Device | None = None) -> dict:
    """{"target_alone_ms", "target_beside_ms", "slowdown", "draft_alone_ms",
    "draft_beside_ms"}: medians of `n` forwards over `window` tokens, the draft's on
    `draft_device` (default: the target's)."""
    model = target.model
    cache = make_prompt_cache(model)
    tokens = mx.arange(CONTEXT)[None] % target.vocab_size
    model(tokens, cache=cache)
    mx.eval([c.state for c in cache])

    def verify() -> None:
        mx.eval(model(tokens[:, :window], cache=cache))
        for c in cache:
            c.trim(window)

    stop = threading.Event()
    draft_times: list[float] = []
    # A draft that reads features costs the same whatever they hold.
    features = mx.zeros((1, window, net.config.hidden_size)) if net.reads_features else None
    mx.eval(features)  # made here, used on the draft's stream: see ExitHead.load

    def draft_loop() -> None:
        # A stream belongs to the thread that makes it (PLATFORM.md), as in MLXDrafter.
        with mx.stream(mx.new_stream(draft_device or mx.default_device())):
            while not stop.is_set():
                start = time.perf_counter()
                # A batched rollout forward's size.
                mx.eval(net(tokens[:, :window], features=features))
                draft_times.append(time.perf_counter() - start)
        mx.clear_streams()  # this thread's MLX state, freed while it holds the GIL (MLXDrafter)

    alone = median_ms(verify, n)
    # The draft alone: the same loop, timed, with nothing beside it.
    worker = threading.Thread(target=draft_loop)
    worker.start()
    time.sleep(0.5)
    stop.set()
    worker.join()
    draft_alone = 1e3 * statistics.median(draft_times)
    draft_times.clear()
    stop.clear()
    worker = threading.Thread(target=draft_loop)
    worker.start()
    time.sleep(0.2)
    beside = median_ms(verify, n)
    stop.set()
    worker.join()
    return {"target_alone_ms": round(alone, 2), "target_beside_ms": round(beside, 2),
            "slowdown": round(beside / alone, 3), "draft_alone_ms": round(draft_alone, 2),
            "draft_beside_ms": round(1e3 * statistics.median(draft_times), 2)}
