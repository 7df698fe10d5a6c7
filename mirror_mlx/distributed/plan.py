"""How the target's layers are split between ranks (pipeline parallel).

Rank 0 keeps the *last* layers, with the final norm and output layer: the logits, and the
hidden states Mirror-SD's early exit reads (5/6 of the depth), then lie where the decoders
run (where a split leaves the exit on the last stage, that stage sends it ahead of the rest
of the forward: pipeline.py). Ranks 1..n-1 hold the first layers in rank order; a forward
travels 0 -> 1 -> ... -> n-1 -> 0 around the ring."""

from __future__ import annotations

from ..errors import InvalidParameter


def layer_counts(num_layers: int, ranks: int, split: str | None = None) -> tuple[int, ...]:
    """Layers per rank, rank 0 first. `split`: comma-separated counts (e.g. "10,20"), else
    as even as possible (rank 0 takes any remainder's last share)."""
    if ranks < 2:
        raise InvalidParameter(f"a pipeline needs at least 2 ranks (got {ranks})")
    if split:
        try:
            counts = tuple(int(x) for x in split.split(","))
        except ValueError:
            raise InvalidParameter(f"--split takes layer counts per rank, e.g. 15,15 "
                                   f"(got '{split}')") from None
        if len(counts) != ranks or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise InvalidParameter(
                f"--split must give each of the {ranks} ranks at least one layer, "
                f"{num_layers} in all (got '{split}')")
        return counts
    if num_layers < ranks:
        raise InvalidParameter(f"the target has {num_layers} layers, fewer than {ranks} ranks")
    base, extra = divmod(num_layers, ranks)
    return tuple(base + (1 if r < extra else 0) for r in range(ranks))


def layer_range(counts: tuple[int, ...], rank: int) -> tuple[int, int]:
    """The layers [begin, end) that `rank` runs."""
    begin = sum(counts[1:rank]) if rank else sum(counts[1:])
    return begin, begin + counts[rank]
