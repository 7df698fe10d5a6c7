"""A process's resident memory, threads and open descriptors, as the kernel counts them (Linux's
/proc; elsewhere memory only, from ps), for the benchmarks that watch for leaks."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcStats:
    rss_mib: float
    threads: int | None  # None where /proc is missing (macOS)
    fds: int | None
    sockets: int | None


def proc_stats(pid: int) -> ProcStats:
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True,
                             text=True, check=True).stdout
        return ProcStats(round(int(out.strip()) / 1024, 1), None, None, None)
    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines()
                  if ":" in line)
    links = []
    for fd in os.listdir(proc / "fd"):
        try:
            links.append(os.readlink(proc / "fd" / fd))
        except FileNotFoundError:  # closed while listed
            pass
    return ProcStats(round(int(status["VmRSS"].split()[0]) / 1024, 1), int(status["Threads"]),
                     len(links), sum(link.startswith("socket:") for link in links))
