"""Starting a run on several ranks: a command given --hosts or --hostfile runs itself again
under mlx.launch (which starts one process per rank, over ssh where a host is not this
machine, and stops them all when one fails), then reports the run's outcome as one error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import DistributedError, InvalidParameter, MissingExtra

STOP_WAIT = 30.0  # seconds the ranks get to end after Ctrl-C
# The backends whose collectives the split uses (all-sums, sends and receives between Macs):
# the ring over TCP, and JACCL over Thunderbolt 5 RDMA (its mesh, or its ring of neighbours).
BACKENDS = ("ring", "jaccl", "jaccl-ring")
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


def read_hostfile(hostfile: str) -> tuple[str, list[str]]:
    """An mlx.launch hostfile's backend ("ring" where it names none, so a hostfile that
    `mlx.distributed_config` wrote for JACCL runs unchanged) and its hosts' names."""
    try:
        data = json.loads(Path(hostfile).read_text())
        hosts = data["hosts"] if isinstance(data, dict) else data
        names = [str(h["ssh"]) for h in hosts]
    except OSError as e:
        raise DistributedError(f"--hostfile {hostfile}: {e.strerror or e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise DistributedError(f"--hostfile {hostfile}: not an mlx.launch hostfile (a JSON "
                               f"list of hosts with an 'ssh' name each: {e!r})") from e
    if len(names) < 2:
        raise DistributedError(f"--hostfile {hostfile}: lists {len(names)} host(s); a split "
                               f"needs at least 2 (list one several times to run several "
                               f"ranks on it)")
    backend = (data.get("backend") if isinstance(data, dict) else None) or "ring"
    if backend not in BACKENDS:
        raise DistributedError(f"--hostfile {hostfile}: backend '{backend}' is not one this "
                               f"runs over ({', '.join(BACKENDS)})")
    return backend, names


def launch_command(argv: list[str], hosts: str | None, hostfile: str | None, port: int,
                   program: tuple[str, ...] = ("-m", "mirror_mlx")) -> list[str]:
    if hostfile:
        backend, names = read_hostfile(hostfile)
        where = ["--hostfile", hostfile]
    else:
        backend, names = "ring", hosts.split(",")
        where = ["--hosts", hosts]
    env = []
    shared = max(names.count(h) for h in names)
    if shared > 1 and "MIRROR_MLX_BLAS_THREADS" not in os.environ:
        # Ranks that share a machine share its cores: BLAS threads that each expect all of
        # them spin against each other (measured on 2 cores, 2 ranks: 5 s a token, 1 s with
        # one thread each).
        env = ["--env", f"MIRROR_MLX_BLAS_THREADS={max(1, (os.cpu_count() or 1) // shared)}"]
    return [launcher(), "--backend", backend, *where, "--starting-port", str(port), *env,
            "--python", sys.executable, "--", *program, *argv]


def relaunch(argv: list[str], hosts: str | None, hostfile: str | None, port: int,
             program: tuple[str, ...] = ("-m", "mirror_mlx")) -> int:
    """Run `program` with `argv` (by default this command line) on every rank; returns the
    exit status. Rank 0's output passes through; when a rank ends badly, one error says
    which, unless rank 0 said it."""
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
