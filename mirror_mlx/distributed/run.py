"""One rank's part in a run: join the group, load the target, choose how to split it (tensor
or pipeline parallel), check that every rank loaded the same and chose alike, then either
follow until rank 0 is done, or (rank 0) hand the split target to the engine."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

import mlx.core as mx

from ..errors import DistributedError, InvalidParameter
from ..models import split as split_model
from ..models.load import load
from . import tensor
from .check import check_ranks
from .launch import launched, relaunch
from .pipeline import Pipeline
from .plan import layer_counts
from .protocol import Link
from .stage import follow
from .watchdog import Watchdog

PARALLEL = ("auto", "pipeline", "tensor")


@dataclass
class Options:
    parallel: str = "auto"
    split: str | None = None  # layers per rank, rank 0 first ("15,15")
    timeout: float = 120.0  # seconds a transfer may take before the run stops


def join() -> object:
    """This rank's group, over the backend its launcher set up (mlx.launch writes
    MLX_JACCL_COORDINATOR for JACCL, MLX_HOSTFILE for the ring)."""
    backend = "jaccl" if "MLX_JACCL_COORDINATOR" in os.environ else "ring"
    try:
        return mx.distributed.init(backend=backend, strict=True)
    except RuntimeError as e:
        raise DistributedError(f"could not join the other ranks: {e}") from e


@contextmanager
def pipelined(model: str | None, dtype: str, options: Options, quiet: bool = False):
    """Rank 0: yields (the target split over the ranks, what runs the other ranks' part: a
    Pipeline or a Tensor), and stops the other ranks at the end. Other ranks: follow (a
    pipeline's stage, or a tensor-parallel shard), then exit."""
    if options.parallel not in PARALLEL:
        raise InvalidParameter(f"--parallel must be one of {', '.join(PARALLEL)}")
    group = join()
    rank, size = group.rank(), group.size()
    target = load(model, dtype=dtype, quiet=quiet or rank != 0)
    split_model.check_splittable(target.model)
    parallel = tensor.choose(target.model, options.parallel, size, options.split)
    counts = layer_counts(target.num_layers, size, options.split) if parallel == "pipeline" \
        else ()
    link = Link(group, options.timeout, Watchdog(rank))
    try:
        check_ranks(link, target.path, {"parallel": parallel, "ranks": size,
                                        "split": list(counts), "dtype": target.dtype})
    except DistributedError:
        if rank:
            raise SystemExit(0) from None  # rank 0 reports it
        raise
    if parallel == "tensor":
        tensor.shard(target.model, group)
    if rank:
        _follow(target.model, link, counts)
    remote = tensor.Tensor(target.model, link) if parallel == "tensor" else \
        Pipeline(target.model, link, counts)
    # The hidden states' dtype: what the embedding gives (its weights may be quantized).
    comm = remote.probe(target.model.model.embed_tokens(mx.array([[0]])).dtype)
    failed = False
    try:
        yield replace(target, split=counts, ranks=size, parallel=parallel, comm_s=comm), remote
    except DistributedError:
        failed = True  # the ring is broken: nothing more can be sent
        raise
    finally:
        if not failed:
            remote.stop()


@contextmanager
def engine_ranks(model: str | None, dtype: str, hosts: str | None, hostfile: str | None,
                 options: Options, port: int, quiet: bool):
    """What Engine(hosts=...) runs on: as `pipelined`, in a process that mlx.launch started.
    Elsewhere, this program starts again on every rank through mlx.launch, as the CLI does,
    and this process exits with the run's status once rank 0's copy of it has ended."""
    if not launched():
        program, argv = this_program()
        raise SystemExit(relaunch(argv, hosts, hostfile, port, program))
    with pipelined(model, dtype, options, quiet) as split:
        yield split


def this_program() -> tuple[tuple[str, ...], list[str]]:
    """How to start this program again (python's arguments before its own), and its own."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return ("-m", spec.name.removesuffix(".__main__")), sys.argv[1:]
    script = sys.argv[0] if sys.argv else ""
    if not script or not os.path.isfile(script):
        raise InvalidParameter(
            "Engine(hosts=...) starts this program again on every rank, which needs a script "
            "(python app.py) or a module (python -m app); from an interactive session, start "
            "a script under mlx.launch instead")
    return (script,), sys.argv[1:]


def _follow(model, link: Link, counts: tuple[int, ...]) -> None:
    """Ranks 1..n-1: serve rank 0's forwards (a stage for a pipeline's `counts`, else every
    layer's shard), then exit."""
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C reaches every local rank: rank 0 decides, and ends the others with STOP.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if counts:
            follow(model, link, counts)
        else:
            tensor.follow(model, link)
    except DistributedError as e:  # rank 0 reports the run's error; this says why here
        print(f"mirror-mlx: rank {link.group.rank()} stopped: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None
    raise SystemExit(0)


def want_layers(pipeline: Pipeline | tensor.Tensor, engine) -> None:
    """Bring back what rank 0 reads from the stages' layers: the draft's features and
    Mirror-SD's early exit."""
    after = list(engine.drafter.feature_layers) if engine.drafter is not None else []
    settings, exit_after = engine.session.settings, None
    if settings.mode == "mirror":
        head = settings.mirror.exit_head
        exit_after = head.layer if head else settings.mirror.exit_layer
    pipeline.want(after, exit_after)

