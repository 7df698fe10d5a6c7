"""Engine(hosts=...): a program that embeds the engine runs over ranks as the CLI does: it
starts again on every rank through mlx.launch, rank 0's engine decodes over the split target
(lossless, as in one process), and the other ranks serve it until it closes."""

import json
import subprocess
import sys
import textwrap

from tests.distributed.conftest import PROMPT, free_ports


def test_an_embedded_engine_runs_over_two_ranks(single, default_gguf, tmp_path):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(f"""
        import json
        from mirror_mlx.api import Engine

        print("starting", flush=True)  # what comes before the engine runs on every rank
        with Engine({str(default_gguf)!r}, mode="sd", gamma=4, hosts="127.0.0.1,127.0.0.1",
                    ring_port={free_ports(2)}, quiet=True) as engine:
            reply = engine.generate({PROMPT!r}, max_tokens=16)
        print(json.dumps({{"ids": reply.token_ids, "ranks": reply.stats.ranks,
                           "split": reply.stats.split}}), flush=True)
    """))
    run = subprocess.run([sys.executable, str(app)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    reply = json.loads(lines[-1])
    assert reply["ids"] == single["ar"].token_ids
    assert (reply["ranks"], reply["split"]) == (2, [15, 15])
    # The launching process and both ranks; only rank 0 gets past the engine.
    assert lines.count("starting") == 3, lines
    assert sum(line.startswith("{") for line in lines) == 1


def test_an_engine_over_ranks_needs_a_program_to_start_again():
    code = ("from mirror_mlx.api import Engine\n"
            "from mirror_mlx.errors import InvalidParameter\n"
            "try:\n    Engine(hosts='127.0.0.1,127.0.0.1')\n"
            "except InvalidParameter as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "starts this program again on every rank" in run.stdout, run
