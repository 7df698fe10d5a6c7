"""What the tests that launch ranks share: the ranks' environment, free ports, and the
single-process references their output is compared with."""

import os
import random
import socket
from pathlib import Path

from mirror_mlx.api import Engine
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.distributed.launch import relaunch

import pytest

ROOT = Path(__file__).resolve().parents[2]
RANKS = str(Path(__file__).with_name("ranks.py"))
PROMPT = "Name three colors."
SAMPLED = SamplingParams(temperature=0.8, seed=3)  # as tests/distributed/ranks.py --sampled


def free_ports(n: int) -> int:
    """A first port from which `n` ports are free now (other runs may share this host). Below
    Linux's ephemeral range (32768-60999 by default), from which the kernel gives ports to
    outgoing connections, the ranks' own among them, until a rank binds the port it was given."""
    for _ in range(100):
        first = random.randrange(20000, 32700)
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports")


def run_ranks(capfd, ranks: int, *args: str) -> tuple[int, str, str]:
    """tests/distributed/ranks.py with `args` on `ranks` ranks: (status, stdout, stderr)."""
    status = relaunch(list(args), ",".join(["127.0.0.1"] * ranks), None, free_ports(ranks),
                      (RANKS,))
    out, err = capfd.readouterr()
    return status, out, err


@pytest.fixture(autouse=True)
def _ranks_env(monkeypatch):
    # The ranks import this checkout, and a rank that hangs must not outlive the test.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (
        str(ROOT), os.environ.get("PYTHONPATH")))))


@pytest.fixture(scope="session")
def single(target):
    """Single-process references: AR's tokens, SD's acceptance with the same fixed gamma,
    seeded SD sampling."""
    out = {}
    for mode in ("ar", "sd"):
        with Engine(target, mode=mode, gamma=4, quiet=True) as engine:
            out[mode] = engine.generate(PROMPT, max_tokens=16)
    with Engine(target, mode="sd", gamma=4, quiet=True) as engine:
        out["sd-sampled"] = engine.generate(PROMPT, max_tokens=16, sampling=SAMPLED)
    return out
