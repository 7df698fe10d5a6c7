"""A program that closes an MLX drafter and exits at once exits cleanly. The drafter's worker
thread holds MLX state of its own (compiled functions, as the draft's activation is); freed at
the thread's end, after the thread has let go of Python, it takes the GIL, and a program
already finalizing aborts ("terminate called without an active exception", seen on a rank
that closed its engine and exited). The program here leaves a compiled function per shape on
the drafter's thread, which widens the window that race needs: without the drafter freeing
its thread's state on close, nearly every run aborts; with the draft's one compiled
activation, about one in twenty."""

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import mirror_mlx  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    from mirror_mlx.draft.base import Job
    from mirror_mlx.draft.mlx_draft import MLXDrafter
    from mirror_mlx.draft.net import DraftConfig, DraftNet

    net = DraftNet(DraftConfig(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=8, vocab_size=64, embed_size=32))
    net.embed_tokens = nn.Embedding(64, 32)
    mx.eval(net.parameters())
    drafter = MLXDrafter(net)
    double = mx.compile(lambda x: 2 * x)
    drafter._pool.submit(lambda: [mx.eval(double(mx.ones((n,)))) for n in range(1, 400)]).result()
    print(drafter.submit(Job([[1, 2, 3]], 3)).result().rollouts[0].tokens)
    drafter.close()
""")


def test_a_program_that_closes_a_drafter_and_exits_exits_cleanly():
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("["), run.stdout
