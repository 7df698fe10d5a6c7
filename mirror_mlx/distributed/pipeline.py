"""Rank 0's side of the pipeline: the target with its first layers replaced by stand-ins
that hand the window to the other ranks. The decoders and the session run this model as
they run any target (mlx-lm's forward, or models/split.py's layer by layer), so they need
no change: the first stand-in sends the window's hidden states around the ring; the
stand-ins of the layers rank 0 reads (the last remote layer, the draft's features, the early
exit) return what came back. Where Mirror-SD's exit lies on the last stage, that stage sends
it (with the kept outputs before it) as soon as it has it, so the branch rollouts start while
the rest of the forward runs, as they do in one process. A stand-in's cache only counts
positions, so the trims the decoders make reach the stages with the next window, as its
`offset`."""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from collections.abc import Iterable
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from .plan import layer_range
from .protocol import DTYPES, FORWARD, PROBE, STOP, Header, Link

PROBES = 20  # round trips timed at start (communication per forward, for the stats)


class Pipeline:
    """The ring as rank 0 sees it: layers [0, end) run on ranks 1..n-1."""

    def __init__(self, model: nn.Module, link: Link, counts: tuple[int, ...]):
        self.link = link
        self.counts = counts
        self.end = sum(counts[1:])
        self.keep: tuple[int, ...] = ()
        self.early = -1  # the kept layer the last stage sends ahead of the rest
        self.early_exits = 0  # forwards whose early exit came ahead of the rest
        self.hidden = model.args.hidden_size
        self._outputs: dict[int, mx.array] = {}
        self._header = Header(FORWARD)  # the current forward's
        self._coming: deque[bool] = deque()  # its messages not yet read (True: the early one)
        self.sessions = Sessions()
        self._session = (0, -1)  # the forward's session number, and one to drop
        self._stopped = False
        layers = model.model.layers
        for i in range(self.end):
            layers[i] = RemoteLayer(self, i, layers[i])

    def want(self, after: Iterable[int], exit_after: int | None = None) -> None:
        """Bring back the hidden states after these many layers (taps, exit layers) when
        the stages hold them, besides those asked for before (several engines, e.g. a
        bench's modes, may share the target); the one after `exit_after` layers ahead of the
        rest where the last stage holds it."""
        wanted = [*after, *([exit_after] if exit_after else [])]
        self.keep = tuple(sorted(set(self.keep) | {n - 1 for n in wanted if 0 < n < self.end}))
        begin, end = layer_range(self.counts, len(self.counts) - 1)
        if exit_after and begin <= exit_after - 1 < end:
            self.early = exit_after - 1

    def layer(self, i: int, h: mx.array, cache) -> mx.array:
        offset = cache.offset
        if i == 0:
            self._session = self.sessions.of(cache)
        cache.offset += h.shape[1]
        if i == 0:
            self._send(h, offset)
        if i in self.keep or i == self.end - 1:
            while i not in self._outputs and self._coming:
                self._receive(self._coming.popleft())
        return self._outputs.get(i, h)

    def _send(self, h: mx.array, offset: int) -> None:
        while self._coming:  # a forward left unfinished (an error inside a step): keep in step
            self._receive(self._coming.popleft())
        early = self.early if self.early in self.keep else -1
        header = Header(FORWARD, h.shape[1], offset, DTYPES.index(h.dtype), self.keep,
                        *self._session, early)
        rows = [h[0]] + [mx.zeros_like(h[0])] * len(self.keep)
        self.link.send(header.array(), 1, "a request")
        self.link.send(mx.stack(rows), 1, "hidden states")
        self._header, self._outputs = header, {}
        self._coming = deque([True, False] if early >= 0 else [False])

    def _receive(self, early: bool) -> None:
        """The early exit's message (the kept outputs up to it), or the forward's end."""
        header, last = self._header, self.link.group.size() - 1
        dtype = DTYPES[header.dtype]
        if early:
            back = self.link.recv(header.early_shape(self.hidden), dtype, last,
                                  "the early exit's hidden states")
            ahead = [k for k in header.keep if k <= header.early]
            self._outputs.update({k: back[j : j + 1] for j, k in enumerate(ahead)})
            self.early_exits += 1
            return
        back = self.link.recv(header.payload_shape(self.hidden), dtype, last, "hidden states")
        self._outputs.update({k: back[j + 1 : j + 2] for j, k in enumerate(header.keep)
                              if k not in self._outputs})
        self._outputs[self.end - 1] = back[:1]

    def probe(self, dtype, rounds: int = PROBES) -> float:
        """Seconds a one-token forward spends in transfers: its request and hidden states
        once around the ring, through no layer (the median of `rounds`)."""
        header = Header(PROBE, 1, 0, DTYPES.index(dtype)).array()
        x = mx.zeros((1, 1, self.hidden), dtype)
        last = self.link.group.size() - 1
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            self.link.send(header, 1, "a probe")
            self.link.send(x, 1, "a probe's hidden states")
            self.link.recv(x.shape, dtype, last, "a probe's hidden states")
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def stop(self) -> None:
        """Tell the stages the run is over (once)."""
        if not self._stopped:
            self._stopped = True
            self.link.send(Header(STOP).array(), 1, "the end of the run")


class Sessions:
    """Rank 0's numbers for its sessions (several engines, a bench's modes): the other ranks
    keep a cache per number. A session is known by its first layer's cache; once that is gone,
    the next request tells the other ranks to free the session's cache."""

    def __init__(self):
        self._numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = 0
        self._gone: deque[int] = deque()  # appended from whichever thread collects a cache

    def of(self, cache) -> tuple[int, int]:
        """(the number of the session `cache` begins, a session to free or -1)."""
        number = self._numbers.get(cache)
        if number is None:
            number, self._next = self._next, self._next + 1
            self._numbers[cache] = number
            weakref.finalize(cache, self._gone.append, number)
        return number, self._gone.popleft() if self._gone else -1


class StandIn(nn.Module):
    """In place of a layer this rank does not run: it keeps the attributes the families'
    forwards read from a layer (which attention window it uses), not its weights."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.use_sliding = getattr(layer, "use_sliding", False)
        self.self_attn = SimpleNamespace(
            is_sliding=getattr(getattr(layer, "self_attn", None), "is_sliding", False))

    def __call__(self, h: mx.array, mask=None, cache=None) -> mx.array:
        raise RuntimeError("this rank does not run this layer")


class RemoteLayer(StandIn):
    """Stands in for layer `index`, which another rank runs."""

    def __init__(self, pipeline: Pipeline, index: int, layer: nn.Module):
        super().__init__(layer)
        self._pipeline = pipeline
        self.index = index

    def __call__(self, h: mx.array, mask=None, cache=None) -> mx.array:
        return self._pipeline.layer(self.index, h, cache)
