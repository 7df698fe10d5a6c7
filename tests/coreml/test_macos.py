"""Core ML itself, on macOS 15+ (skipped elsewhere, with the reason): the package's predictions
against the MLX draft, Mirror-SD end to end with the draft on the Neural Engine, and where Core
ML places the ops. Written against coremltools 9.0's real API; not yet run on a Mac, so the fp16
tolerance and the placement thresholds below are first estimates to confirm there."""

from collections import Counter

from mirror_mlx.api import Engine
from mirror_mlx.decode.mirror import MirrorConfig
from mirror_mlx.draft.coreml_draft import (
    CoreMLDrafter,
    CoreMLExecutor,
    compiled_package,
    mlx_embedding,
    read_package_spec,
)
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.mlx_draft import MLXExecutor
from mirror_mlx.draft.select import make_drafter
from mirror_mlx.platform import coreml_can_run, coreml_status
from mirror_mlx.session import DecodeSettings, Session

import numpy as np
import pytest

from coreml_export.convert import export_draft
from coreml_export.inspect import placement
from tests.coreml.test_parity import scenario
from tests.prompts import PROMPTS

pytestmark = [pytest.mark.macos,
              pytest.mark.skipif(not coreml_can_run(),
                                 reason=f"needs Core ML prediction: {coreml_status()[1]}")]


def fp16_close(a: np.ndarray, b: np.ndarray) -> None:
    """The package computes in fp16 on the Neural Engine, MLX in float32: a loose bound, and
    each side's best token among the other's five best (random weights leave near-ties)."""
    assert np.abs(a - b).max() <= 0.05 + 0.01 * np.abs(a).max()
    top5 = np.argsort(-b, axis=-1)[:, :5]
    assert all(a_best in row for a_best, row in zip(a.argmax(-1), top5))


def test_package_predictions_match_mlx(package, small_draft, target):
    import coremltools as ct

    spec = read_package_spec(package)
    model = ct.models.CompiledMLModel(str(compiled_package(package)),
                                      compute_units=ct.ComputeUnit.CPU_AND_NE)
    coreml = CoreMLExecutor(model, spec, mlx_embedding(target.model.model.embed_tokens))
    scenario(MLXExecutor(small_draft), coreml, target.tokenizer, fp16_close)


def test_mirror_with_draft_on_neural_engine(target, small_draft_folder, package, tmp_path):
    # A package beside a draft folder is picked up by itself.
    assert isinstance(make_drafter(str(small_draft_folder), target), CoreMLDrafter)

    out = tmp_path / "self4.mlpackage"
    export_draft(load_draft("self:4", target), out, source="self:4", context=512,
                 max_branch_tokens=8, quiet=True)
    drafter = make_drafter(str(out), target)
    assert isinstance(drafter, CoreMLDrafter)
    engine = Engine(target, mode="ar")
    session = Session(target, None, drafter,
                      DecodeSettings("mirror", 5, MirrorConfig(kappa=8, exit_layer=25, budget=4)))
    outcomes = Counter()
    for prompt in PROMPTS[:3]:
        expected = engine.generate(prompt, max_tokens=32).token_ids
        session.reset()
        session.timeline = []
        out_ids = [t for chunk in session.generate(engine.encode(prompt), max_tokens=32)
                   for t in chunk.token_ids]
        assert out_ids == expected
        outcomes += Counter(label.split(":")[1] for label, _, _ in session.timeline
                            if label.startswith("outcome:"))
    assert outcomes["branch"], outcomes  # KV slots were moved inside the Core ML state
    drafter.close()


def test_heavy_ops_run_on_neural_engine(package):
    plan = placement(package)
    print("\n".join(plan.lines()))
    # The cache writes count too: a state write that leaves the Neural Engine costs a round
    # trip per layer (coremltools #2553).
    kept = ("conv", "einsum", "softmax", "matmul", "slice_update", "read_state", "write_state")
    heavy = [(op, dev) for op, dev in plan.off_ne if any(k in op for k in kept)]
    assert heavy == [], heavy
    assert plan.cost.get("NE", 0.0) >= 0.9, plan.cost


def test_selftest_passes_on_a_mac():
    """`doctor --selftest`: every check runs on a Mac (energy may still be unavailable)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mirror_mlx", "doctor", "--selftest"],
                          capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok] Core ML op placement" in done.stdout
    assert done.stdout.count("through Core ML (CPU_AND_NE)") == 2
