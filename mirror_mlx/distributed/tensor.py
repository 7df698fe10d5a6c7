"""Tensor parallelism: every rank holds every layer with its share of the attention heads and
of the MLP's width (mlx-lm's own `shard()`), and each layer sums the shares with two
all-reduces (after its attention's and its MLP's output projections).

Rank 0 runs the decoders on its shard unchanged; the other ranks follow. Every rank must run
the same all-reduces in the same order, so every forward rank 0 makes (whole, or split at
Mirror-SD's early exit) begins with an announcement made by its first layer: a fixed-size
header (the window's length, and the cache offset it continues from: the followers trim what
rank 0 trimmed since), then the window's hidden states, each as an all-reduce to which the
followers give zeros; then each follower runs all its layers over them (the logits are rank
0's alone: the final norm and output layer are not split).

Rank 0's last layer dispatches the forward's all-reduces (mx.async_eval) as soon as the
decoders have built it, whether or not they read its logits: a prefill reads only the caches,
which leaves the last layer's own all-reduces out, while the followers run them. The next
announcement first waits for them, so two forwards' collectives never interleave, from
whichever thread each runs. The decoders wait for a forward's all-reduces wherever they read
its outputs, out of the watchdog's sight; so each forward is bounded from its announcement
until a thread of this module has seen its last layer's output land (or a rank that went
silent inside a forward would hang rank 0). A draft never runs the target's layers here
(draft/load.py refuses a draft made of them), so no collective runs on the draft's thread."""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time

import mlx.core as mx
import mlx.nn as nn

from ..errors import DistributedError, InvalidParameter
from ..models import split
from ..models.load import materialize
from . import stage
from .pipeline import PROBES, Sessions, StandIn
from .protocol import DTYPES, FORWARD, HEADER, PROBE, STOP, Header, Link


def unshardable(model: nn.Module, ranks: int) -> str | None:
    """Why `model` cannot be split over `ranks` ranks by tensor parallelism (None: it can)."""
    kind = getattr(model, "model_type", "?")
    if not hasattr(model, "shard") or not split.splittable(model):
        return f"mlx-lm has no tensor-parallel split (shard()) for model type '{kind}'"
    args = model.args
    counts = {"{} attention heads": args.num_attention_heads,
              "{} key/value heads": getattr(args, "num_key_value_heads", None)
              or args.num_attention_heads,
              "MLP width of {}": args.intermediate_size}
    bad = [name.format(n) for name, n in counts.items() if n % ranks]
    if not bad:
        return None
    common = math.gcd(*counts.values())
    fits = [str(r) for r in range(2, common + 1) if common % r == 0][:6]
    listed = ", ".join(bad[:-1]) + (" and " if len(bad) > 1 else "") + bad[-1]
    verb = "does" if bad[0].startswith("MLP") else "do"
    return (f"its {listed} {verb} not divide by {ranks} ranks (tensor parallelism gives "
            "every rank an equal share of the heads and of the MLP's width); "
            + (f"rank counts that divide them all: {', '.join(fits)}" if fits
               else "no rank count divides them all"))


def choose(model: nn.Module, parallel: str, ranks: int, layer_split: str | None) -> str:
    """"tensor" or "pipeline" for `--parallel` `parallel` ("auto": tensor where the family
    shards evenly over the ranks and no --split asks for a pipeline)."""
    why = unshardable(model, ranks)
    if parallel == "tensor":
        if why:
            raise InvalidParameter(f"--parallel tensor: {why}; --parallel pipeline splits "
                                   "this target by layers instead")
        if layer_split:
            raise InvalidParameter("--split gives a pipeline's layers per rank; under "
                                   "--parallel tensor every rank runs every layer")
    if parallel == "auto":
        return "pipeline" if why or layer_split else "tensor"
    return parallel


def shard(model: nn.Module, group) -> None:
    model.shard(group)
    materialize(model)  # the shares are lazy slices, and decoding runs on another thread


class Tensor:
    """Rank 0's side: its first and last layers wrapped to announce and dispatch each
    forward."""

    def __init__(self, model: nn.Module, link: Link):
        self.link = link
        self._tail: mx.array | None = None  # the latest forward's last layer output
        self._open = False  # a forward announced whose last layer was not built yet
        self.sessions = Sessions()
        self._stopped = False
        self.hidden = model.args.hidden_size
        self.layers = len(model.model.layers)
        self._bound: int | None = None  # the watchdog's token for the forward in flight
        self._landing: queue.Queue = queue.Queue()  # (last layer output, token); None: end
        threading.Thread(target=self._land, name="mirror-tensor-forwards", daemon=True).start()
        layers = model.model.layers
        last = len(layers) - 1
        layers[0] = Announcing(self, layers[0], first=True, last=last == 0)
        if last:
            layers[last] = Announcing(self, layers[last], first=False, last=True)

    def want(self, after, exit_after=None) -> None:
        """Nothing to bring back: every layer's output is on rank 0 (see Pipeline.want)."""

    def announce(self, h: mx.array, cache) -> None:
        session = self.sessions.of(cache)
        self._settle()
        self.link.broadcast(Header(FORWARD, h.shape[1], cache.offset,
                                   DTYPES.index(h.dtype), (), *session).array(),
                            "a request")
        self.link.broadcast(h[:1], "hidden states")
        self._open = True
        self._bound = self.link.watchdog.arm("running a forward's layers with the other ranks",
                                             self.link.timeout)

    def dispatch(self, out: mx.array) -> None:
        self._open = False
        self._tail = out
        mx.async_eval(out)
        self._landing.put((out, self._bound))

    def _land(self) -> None:
        """Lift each forward's bound once its last layer's output has landed (waiting for an
        array another thread dispatched is safe; the decoders report any failure)."""
        while (item := self._landing.get()) is not None:
            out, token = item
            try:
                mx.eval(out)
            except RuntimeError:
                pass
            self.link.watchdog.disarm(token)

    def _settle(self) -> None:
        """Wait for the last forward's all-reduces: the followers run them all."""
        if self._open:
            raise DistributedError("a forward across ranks was left unfinished (its last "
                                   "layers never ran), and the other ranks wait in it")
        if self._tail is not None:
            self.link.wait(self._tail, "running the last forward's layers with the other ranks")
            self._tail = None

    def probe(self, dtype, rounds: int = PROBES) -> float:
        """Seconds a one-token forward spends in all-reduces: its announcement's two and two
        per layer, each timed as one of a one-token window's hidden states (the median of
        `rounds`)."""
        self._settle()
        x = mx.zeros((1, 1, self.hidden), dtype)
        times = []
        for _ in range(rounds):
            self.link.broadcast(Header(PROBE, 1, 0, DTYPES.index(dtype)).array(), "a probe")
            start = time.perf_counter()
            self.link.broadcast(x, "a probe's hidden states")
            times.append(time.perf_counter() - start)
        return statistics.median(times) * (2 + 2 * self.layers)

    def stop(self) -> None:
        """Tell the followers the run is over (once)."""
        if not self._stopped:
            self._stopped = True
            self._settle()
            self.link.broadcast(Header(STOP).array(), "the end of the run")
            self._landing.put(None)


class Announcing(StandIn):
    """Rank 0's first layer (announces each forward) and last layer (dispatches it)."""

    def __init__(self, tensor: Tensor, layer: nn.Module, first: bool, last: bool):
        super().__init__(layer)
        self.layer = layer
        self._tensor = tensor
        self._first, self._last = first, last

    def __call__(self, h: mx.array, mask=None, cache=None) -> mx.array:
        if self._first:
            self._tensor.announce(h, cache)
        out = self.layer(h, mask, cache=cache)
        if self._last:
            self._tensor.dispatch(out)
        return out


def follow(model: nn.Module, link: Link) -> None:
    """Ranks 1..n-1: run every forward rank 0 announces on this rank's shard, until STOP."""
    rank = link.group.rank()
    caches: dict[int, list] = {}  # by rank 0's session number
    n = len(model.model.layers)
    hidden = model.args.hidden_size
    while True:
        header = Header.of(link.broadcast(mx.zeros((HEADER,), mx.int32), "the next request",
                                          bounded=False))
        if header.op == STOP:
            return
        if header.op not in (FORWARD, PROBE):
            raise RuntimeError(f"rank {rank}: unknown request {header.op}")
        x = link.broadcast(mx.zeros(header.payload_shape(hidden), DTYPES[header.dtype]),
                           "hidden states")
        if header.op == PROBE:
            continue
        cache = stage.session_cache(caches, model, header)
        stage.trim(cache, header.offset, rank)
        link.wait(stage.run_stage(model, x, cache, 0, n, ()), "running the layers with rank 0")
