"""What rank 0 and the other ranks say to each other, and how each transfer is made.

Every message has a shape both sides know before it is sent (MLX's transports do not carry
shapes): a fixed-size header first, then the hidden states whose shape the header gives. A
pipeline passes them around the ring (send/recv); under tensor parallelism rank 0 broadcasts
them to every rank (an all-reduce).
Each transfer is evaluated at once: ranks that evaluate collectives in different orders
deadlock. Each is bounded by the watchdog (watchdog.py) except a stage's wait for rank 0's
next request, which may come after a user has typed for minutes."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import DistributedError
from .watchdog import Watchdog

HEADER = 16
MAX_KEEP = HEADER - 8
FORWARD, STOP, PROBE = 1, 2, 3
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class Header:
    """FORWARD: a window of `length` positions whose hidden states follow (a pipeline's
    first stage gets the embedding, and so do the ranks of a tensor-parallel target: token ids
    would do there too, but the embedding keeps the families' embedding scales on rank 0, and
    costs what one of the forward's 2 all-reduces per layer costs), to be appended after the
    first `offset` positions of the cache each rank keeps for rank 0's session number
    `session` (a rank trims what rank 0 has trimmed since: rejected drafts). `drop`: a
    session rank 0 no longer has, whose cache the ranks free (-1: none). `keep`: the layers
    whose outputs travel back too (the draft's features, Mirror-SD's early exit), in order.
    `early`: a kept layer of the last stage (Mirror-SD's exit) whose output, with the kept
    outputs before it, that stage sends to rank 0 as soon as it has it (-1: none).
    STOP: the run is over. PROBE: the hidden states of a one-token window travel as a
    forward's would, through no layer (what a forward's communication costs, measured at
    start)."""

    op: int
    length: int = 0
    offset: int = 0
    dtype: int = 0  # index into DTYPES
    keep: tuple[int, ...] = ()
    session: int = 0
    drop: int = -1
    early: int = -1

    def array(self) -> mx.array:
        if len(self.keep) > MAX_KEEP:
            raise DistributedError(f"at most {MAX_KEEP} layers' outputs can travel back "
                                   f"(asked for {len(self.keep)})")
        values = [self.op, self.length, self.offset, self.dtype, self.session, self.drop,
                  self.early, len(self.keep), *self.keep]
        return mx.array(values + [-1] * (HEADER - len(values)), dtype=mx.int32)

    @staticmethod
    def of(a: mx.array) -> Header:
        v = a.tolist()
        return Header(v[0], v[1], v[2], v[3], tuple(v[8 : 8 + v[7]]), v[4], v[5], v[6])

    def payload_shape(self, hidden: int) -> tuple[int, int, int]:
        """The hidden states: the current one, then one per kept layer."""
        return (1 + len(self.keep), self.length, hidden)

    def early_shape(self, hidden: int) -> tuple[int, int, int]:
        """The early message: the kept layers' outputs up to `early`, in order."""
        return (sum(k <= self.early for k in self.keep), self.length, hidden)


class Link:
    """This rank's point-to-point transfers in `group`, each evaluated at once and bounded
    by `timeout` seconds."""

    def __init__(self, group, timeout: float, watchdog: Watchdog):
        self.group = group
        self.timeout = timeout
        self.watchdog = watchdog

    def send(self, x: mx.array, dst: int, what: str) -> None:
        self._eval(mx.distributed.send(x, dst, group=self.group), f"sending {what} to rank {dst}",
                   self.timeout)

    def recv(self, shape, dtype, src: int, what: str, bounded: bool = True) -> mx.array:
        x = mx.distributed.recv(shape, dtype, src, group=self.group)
        self._eval(x, f"waiting for {what} from rank {src}", self.timeout if bounded else None)
        return x

    def broadcast(self, x: mx.array, what: str, bounded: bool = True) -> mx.array:
        """Rank 0's `x` on every rank: an all-reduce to which the others give zeros of the
        same shape (adding zeros is exact)."""
        out = mx.distributed.all_sum(x, group=self.group)
        self._eval(out, f"exchanging {what}", self.timeout if bounded else None)
        return out

    def wait(self, x: mx.array, doing: str) -> None:
        """Evaluate `x`, whose graph holds collectives, within the bound."""
        self._eval(x, doing, self.timeout)

    def gather(self, x: mx.array, what: str) -> mx.array:
        out = mx.distributed.all_gather(x, group=self.group)
        self._eval(out, f"exchanging {what}", self.timeout)
        return out

    def _eval(self, x: mx.array, doing: str, timeout: float | None) -> None:
        with self.watchdog.bound(doing, timeout):
            try:
                mx.eval(x)
            except RuntimeError as e:
                raise DistributedError(f"{doing} failed: {e} (a rank died or cannot be "
                                       "reached)") from e
