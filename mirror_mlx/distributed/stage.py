"""A stage: what ranks 1..n-1 do. Each runs its share of the target's layers whenever rank 0
sends a window's hidden states, and passes the result on around the ring, until rank 0 says
stop. A stage has no tokenizer, draft or sampler: every decision is rank 0's."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..models import split
from .pipeline import StandIn
from .plan import layer_range
from .protocol import DTYPES, FORWARD, HEADER, PROBE, STOP, Header, Link


def run_stage(model: nn.Module, x: mx.array, cache: list, begin: int, end: int,
              keep: tuple[int, ...], early: int = -1,
              send_early: Callable[[mx.array], None] | None = None) -> mx.array:
    """Layers [begin, end) over `x` (the current hidden state, then the kept layers'
    outputs so far); returns `x` with the current state and this stage's kept outputs.
    After layer `early`, `send_early` gets the kept outputs up to it: rank 0 starts on the
    early exit while this stage and rank 0's own layers finish the forward."""
    h = x[:1]
    masks = split.layer_masks(model, h, cache, begin, end)
    rows = [x[j + 1 : j + 2] for j in range(len(keep))]
    layers = model.model.layers
    for i in range(begin, end):
        h = layers[i](h, masks[i - begin], cache=cache[i])
        if i in keep:
            rows[keep.index(i)] = h
        if i == early and send_early is not None:
            send_early(mx.concatenate([r for r, k in zip(rows, keep) if k <= early]))
    return mx.concatenate([h, *rows]) if rows else h


def session_cache(caches: dict[int, list], model: nn.Module, header: Header) -> list:
    """The cache this rank keeps for the forward's session (made at its first forward), after
    freeing the one of a session rank 0 no longer has."""
    caches.pop(header.drop, None)
    if header.session not in caches:
        caches[header.session] = split.make_cache(model)
    return caches[header.session]


def trim(cache: list, offset: int, rank: int) -> None:
    """Drop what rank 0 has trimmed since the last forward (rejected drafts)."""
    for c in cache:
        if c.offset < offset:
            raise RuntimeError(f"rank {rank}: asked to continue at position {offset} but "
                               f"holds {c.offset}")
        c.trim(c.offset - offset)


def follow(model: nn.Module, link: Link, counts: tuple[int, ...]) -> None:
    """Serve rank 0's forwards until it sends STOP."""
    rank, size = link.group.rank(), link.group.size()
    begin, end = layer_range(counts, rank)
    split.check_splittable(model)
    for i, layer in enumerate(model.model.layers):
        if not begin <= i < end:
            model.model.layers[i] = StandIn(layer)  # frees the weights it never runs
    caches: dict[int, list] = {}  # by rank 0's session number
    hidden = model.args.hidden_size
    src, dst = rank - 1, (rank + 1) % size
    while True:
        header = Header.of(link.recv((HEADER,), mx.int32, src, "the next request",
                                     bounded=False))
        if dst != 0:
            link.send(header.array(), dst, "the request")
        if header.op == STOP:
            return
        if header.op not in (FORWARD, PROBE):
            raise RuntimeError(f"rank {rank}: unknown request {header.op}")
        x = link.recv(header.payload_shape(hidden), DTYPES[header.dtype], src,
                      "hidden states")
        if header.op == PROBE:
            link.send(x, dst, "hidden states")
            continue
        cache = session_cache(caches, model, header)
        trim(cache[begin:end], header.offset, rank)
        # Only the last stage sends early: rank 0 is its next hop (the ring's transports
        # connect neighbours only), and the exit lies there unless rank 0 holds it.
        early = header.early if dst == 0 and begin <= header.early < end else -1
        link.send(run_stage(model, x, cache, begin, end, header.keep, early,
                            lambda rows: link.send(rows, 0, "the early exit's hidden states")),
                  dst, "hidden states")
