"""A stage: what ranks 1..n-1 do. Each runs its share of the target's layers whenever rank 0
sends a window's hidden states, and passes the result on around the ring, until rank 0 says
stop. A stage has no tokenizer, draft or sampler: every decision is rank 0's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..models import split
from .pipeline import StandIn
from .plan import layer_range
from .protocol import DTYPES, FORWARD, HEADER, PROBE, STOP, Header, Link


def run_stage(model: nn.Module, x: mx.array, cache: list, begin: int, end: int,
              keep: tuple[int, ...]) -> mx.array:
    """Layers [begin, end) over `x` (the current hidden state, then the kept layers'
    outputs so far); returns `x` with the current state and this stage's kept outputs."""
    h = x[:1]
    masks = split.layer_masks(model, h, cache, begin, end)
    rows = [x[j + 1 : j + 2] for j in range(len(keep))]
    layers = model.model.layers
    for i in range(begin, end):
        h = layers[i](h, masks[i - begin], cache=cache[i])
        if i in keep:
            rows[keep.index(i)] = h
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
        link.send(run_stage(model, x, cache, begin, end, header.keep), dst, "hidden states")
