"""The launch command for a hostfile: the backend it names (JACCL's hostfiles run unchanged),
ranks sharing a machine sharing its cores, and hostfiles that cannot work refused with what
is wrong, before any rank starts."""

import json
import subprocess
import sys

from mirror_mlx.distributed.launch import launch_command
from mirror_mlx.errors import DistributedError

import mlx.core as mx
import pytest

# As `mlx.distributed_config --backend jaccl --over thunderbolt` writes it for three Macs.
JACCL = {
    "backend": "jaccl",
    "envs": ["MLX_METAL_FAST_SYNCH=1"],
    "hosts": [
        {"ssh": "mac-1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en2", "rdma_en3"]},
        {"ssh": "mac-2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None, "rdma_en3"]},
        {"ssh": "mac-3", "ips": ["10.0.0.3"], "rdma": ["rdma_en2", "rdma_en3", None]},
    ],
}


def write(tmp_path, data) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_a_jaccl_hostfile_launches_jaccl(tmp_path, monkeypatch):
    monkeypatch.delenv("MIRROR_MLX_BLAS_THREADS", raising=False)
    path = write(tmp_path, JACCL)
    command = launch_command(["generate"], None, path, 32323)
    assert option(command, "--backend") == "jaccl"
    assert option(command, "--hostfile") == path
    assert "--env" not in command  # one rank per Mac: each has its cores
    ring = launch_command(["generate"], None, write(tmp_path, {**JACCL, "backend": "jaccl-ring"}),
                          32323)
    assert option(ring, "--backend") == "jaccl-ring"


def test_a_hostfile_without_a_backend_runs_the_ring(tmp_path, monkeypatch):
    """mlx.launch's older form (a bare list); two ranks on one machine split its cores."""
    monkeypatch.delenv("MIRROR_MLX_BLAS_THREADS", raising=False)
    hosts = [{"ssh": "mac-1", "ips": ["10.0.0.1"]}] * 2
    command = launch_command(["chat"], None, write(tmp_path, hosts), 32323)
    assert option(command, "--backend") == "ring"
    assert option(command, "--env").startswith("MIRROR_MLX_BLAS_THREADS=")


@pytest.mark.parametrize("data, says", [
    (None, "No such file"),
    ("{not json", "not an mlx.launch hostfile"),
    ({"hosts": [{"ips": ["10.0.0.1"]}, {"ips": ["10.0.0.2"]}]}, "'ssh'"),
    ({**JACCL, "backend": "mpi"}, "backend 'mpi'"),
    ({"hosts": JACCL["hosts"][:1]}, "lists 1 host(s)"),
])
def test_a_hostfile_that_cannot_work_is_refused(tmp_path, data, says):
    path = str(tmp_path / "missing.json") if data is None else write(tmp_path, data)
    with pytest.raises(DistributedError, match=says.replace("(", r"\(").replace(")", r"\)")):
        launch_command(["generate"], None, path, 32323)


@pytest.mark.skipif(mx.distributed.is_available("jaccl"),
                    reason="RDMA is enabled here: joining would wait for a real coordinator")
def test_a_rank_launched_for_jaccl_joins_jaccl():
    """Under the environment mlx.launch sets for JACCL, a rank asks MLX for JACCL (not the
    ring): where RDMA is not enabled, the error says so."""
    code = ("from mirror_mlx.distributed.run import join\n"
            "try:\n    join()\nexcept Exception as e:\n    print(e)\n")
    env = {"MLX_JACCL_COORDINATOR": "127.0.0.1:32323", "MLX_RANK": "0", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert "could not join the other ranks" in out.stdout and "jaccl" in out.stdout, out
