"""Starting a run on several ranks: a command given --hosts or --hostfile runs itself again
under mlx.launch (which starts one process per rank, over ssh where a host is not this
machine, and stops them all when one fails), then reports the run's outcome as one error."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import DistributedError, InvalidParameter, MissingExtra

STOP_WAIT = 30.0  # seconds the ranks get to end after Ctrl-C
# mlx.launch's own lines about ranks that ended (its warnings are colored).
_ENDED = re.compile(r"Node with rank (\d+) (was killed|exited with code (-?\d+))")


def launched() -> bool:
    """This process is a rank that a launcher started (it set the documented environment)."""
    return "MLX_RANK" in os.environ


def launcher() -> str:
    beside = Path(sys.executable).with_name("mlx.launch")
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise MissingExtra("running across processes needs mlx.launch (part of mlx)")
    return found


def launch_command(argv: list[str], hosts: str | None, hostfile: str | None, port: int,
                   program: tuple[str, ...] = ("-m", "mirror_mlx")) -> list[str]:
    where = ["--hostfile", hostfile] if hostfile else ["--hosts", hosts]
    env = []
    shared = max(hosts.split(",").count(h) for h in hosts.split(",")) if hosts else 1
    if shared > 1 and "MIRROR_MLX_BLAS_THREADS" not in os.environ:
        # Ranks that share a machine share its cores: BLAS threads that each expect all of
        # them spin against each other (measured on 2 cores, 2 ranks: 5 s a token, 1 s with
        # one thread each).
        env = ["--env", f"MIRROR_MLX_BLAS_THREADS={max(1, (os.cpu_count() or 1) // shared)}"]
    return [launcher(), "--backend", "ring", *where, "--starting-port", str(port), *env,
            "--python", sys.executable, "--", *program, *argv]


def relaunch(argv: list[str], hosts: str | None, hostfile: str | None, port: int,
             program: tuple[str, ...] = ("-m", "mirror_mlx")) -> int:
    """Run `program` with `argv` (by default this command line) on every rank; returns the
    exit status. Rank 0's output passes through; when a rank ends badly, one error says
    which, unless rank 0 said it."""
    if hostfile and not Path(hostfile).is_file():
        raise DistributedError(f"--hostfile {hostfile}: no such file")
    if not hostfile and len(hosts.split(",")) < 2:
        raise InvalidParameter("--hosts needs at least 2 addresses (repeat one to run "
                               "several ranks on a machine)")
    proc = subprocess.Popen(launch_command(argv, hosts, hostfile, port, program),
                            stderr=subprocess.PIPE, text=True, errors="replace")
    ended: dict[int, str] = {}
    errors: set[str] = set()
    try:
        for line in proc.stderr:
            m = _ENDED.search(line)
            if m:
                ended[int(m.group(1))] = m.group(2)
                continue
            if line.startswith("[ring] ") and "MLX_RING_VERBOSE" not in os.environ:
                continue  # the transport's own account of a lost peer: the error says it
            if line.startswith("mirror-mlx: error"):
                if line in errors:
                    continue  # every rank found the same fault in the same arguments
                errors.add(line)
            sys.stderr.write(line)
            sys.stderr.flush()
        status = proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the local ranks too: rank 0 stops the others. Return once they end.
        try:
            proc.wait(timeout=STOP_WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if not ended:
        return status
    if not errors:
        # The first rank that ended on its own; the launcher then stopped the others.
        rank, how = next(iter(ended.items()))
        print(f"mirror-mlx: error: rank {rank} {how}; every rank stopped", file=sys.stderr)
    return 1
