"""`mirror-mlx bench` end to end on the default model, the mlx-lm draft adapter, the energy
phase, and the speedup arithmetic."""

import json
import subprocess
import sys
from types import SimpleNamespace

import mirror_mlx  # noqa: F401  (first: OpenBLAS before MLX)
from mirror_mlx.bench.harness import BenchConfig, Run, run_bench
from mirror_mlx.bench.mlx_lm_modes import MLXLMDraft
from mirror_mlx.bench.prompts import BenchPrompt
from mirror_mlx.bench.report import energy_summary, ranks_summary, run_metrics, spread
from mirror_mlx.cli import main
from mirror_mlx.decode.stats import GenerationStats
from mirror_mlx.draft.net import DraftConfig, DraftNet
from mirror_mlx.energy.rapl import RaplMeter
from mirror_mlx.energy.select import MeterChoice

import mlx.core as mx
import numpy as np
import pytest
from matplotlib.image import imread
from mlx_lm.generate import generate_step, speculative_generate_step

MODES = ["ar", "sd", "mirror", "mlx-lm", "mlx-lm-sd"]
TINY = [{"question_id": 1, "category": "qa", "turns": ["Name two colours."]},
        {"question_id": 2, "category": "writing", "turns": ["Say hello.", "Say it again."]}]


def test_bench_end_to_end(default_gguf, tmp_path):
    prompts = tmp_path / "tiny.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in TINY) + "\n")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "mirror_mlx", "bench", "--target", str(default_gguf),
         "--prompts", str(prompts), "--max-tokens", "4", "--gamma", "2",
         "--energy-seconds", "1", "--separate-units", "--branch-budget", "2",
         "--draft-device", "cpu", "--exit-head", "none", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "energy: " in done.stderr and "bench [" in done.stderr  # meter choice, progress

    doc = json.loads((out / "bench.json").read_text())
    assert doc["config"]["modes"] == MODES and doc["config"]["max_tokens"] == 4
    assert doc["config"]["exit_head"] == "none" and doc["config"]["draft_device"] == "cpu"
    assert doc["draft"]["spec"] == "auto (default)"  # what --draft auto resolved to
    assert doc["machine"]["mlx_version"] and doc["versions"]["mlx-lm"]
    runs = doc["runs"]
    assert len(runs) == 5 * 3  # five modes x (one single-turn + one two-turn question)
    for r in runs:
        stats = r["stats"]
        assert 1 <= len(r["token_ids"]) <= 4
        assert stats["generated_tokens"] == len(r["token_ids"])
        assert 0 < r["ttft_s"] <= r["latency_s"]
        assert stats["committed_tokens"] - stats["generated_tokens"] in (0, 1)  # EOS
        assert 1 <= stats["target_steps"] <= stats["committed_tokens"]
        if r["mode"] in ("ar", "mlx-lm"):
            assert stats["acceptance_length"] == 1.0
    # The second turn's prompt holds the first turn and the mode's own first reply.
    for mode in MODES:
        first, second = ([r for r in runs if r["mode"] == mode and r["question_id"] == "2"
                          and r["turn"] == t][0] for t in (0, 1))
        assert second["stats"]["prompt_tokens"] >= (first["stats"]["prompt_tokens"]
                                                    + len(first["token_ids"]))
    # Greedy, float32 on the CPU: every mode, ours and mlx-lm's, gives AR's tokens exactly
    # (not even a tie).
    agreement = doc["summary"]["greedy_agreement"]
    assert {m: (a["identical"], a["total"], a["ties"], a["mismatches"])
            for m, a in agreement.items()} == {m: (3, 3, 0, 0) for m in MODES[1:]}
    assert all(r["identity"] is None for r in runs)
    summary = doc["summary"]
    assert set(summary["per_category"]) == {"qa", "writing"}
    assert set(summary["per_prompt"]) == {"1", "2"}
    assert summary["overall"]["ar"]["speedup_vs_ar"]["median"] == 1.0
    assert summary["overall"]["mirror"]["reuse_rate"] is not None
    assert summary["overall"]["sd"]["reuse_rate"] is None
    labels = {s["label"] for s in doc["timeline"]}
    assert {"target_prefix", "target_suffix"} <= labels  # a pinned budget splits every step
    units = summary["units"]
    assert units["separate_units"] and units["blas_threads"] == 1 and units["draft_device"] == "cpu"
    assert units["target_alone_ms"] > 0 and units["slowdown"] > 0
    assert summary["schedule"]["plan_steps"] == {"early+2": sum(
        r["stats"]["target_steps"] for r in runs if r["mode"] == "mirror")}
    energy = summary["energy"]
    if energy["backend"] == "none":
        assert energy["note"].startswith("unavailable: ") and not energy["modes"]
    else:
        assert set(energy["modes"]) == set(MODES)

    md = (out / "bench.md").read_text()
    for label in ("AR (ours)", "SD (ours)", "Mirror-SD (ours)", "mlx-lm", "mlx-lm SD"):
        assert f"| {label} | 3 |" in md
        assert f"| writing | {label} | 2 |" in md
    assert "## Energy" in md and energy["note"] in md
    assert "- Mirror-SD (ours): 3/3 generations token-identical, 0 ties, 0 mismatches\n" in md
    assert "A core each for target and draft" in md and "steps per plan: early+2" in md
    for png in ("speedup_by_category.png", "tokens_per_second.png", "mirror_timeline.png"):
        assert f"]({png})" in md
        image = imread(out / png)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert image[..., :3].std() > 0.05  # drawn on, not blank


def test_bench_rejects_bad_input_before_loading(tmp_path, capsys):
    assert main(["bench", "--prompts", str(tmp_path / "absent.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mirror-mlx: error: ") and "cannot read the prompt file" in err
    assert "\n" not in err
    assert main(["bench", "--modes", "ar,turbo"]) == 1
    assert "--modes takes distinct modes from" in capsys.readouterr().err


def test_energy_phase_with_a_rapl_tree(target, tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("5000000\n")
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    meter = MeterChoice(RaplMeter(tmp_path), "rapl", "fixture tree")
    config = BenchConfig(modes=("ar", "mlx-lm"), max_tokens=6, energy_seconds=0.2)
    # A reply that ends with end-of-sequence ("No.") after two tokens.
    prompt = BenchPrompt("x", "qa", ("Is the sky blue? Answer yes or no.",))
    result = run_bench(target, [prompt], config, meter, quiet=True)
    ours, theirs = result.runs
    assert (ours.mode, theirs.mode) == ("ar", "mlx-lm")
    assert ours.token_ids == theirs.token_ids and len(ours.token_ids) < 6
    for r in (ours, theirs):
        s = r.stats
        assert s.finish_reason == "stop"
        assert s.committed_tokens == s.generated_tokens + 1 == s.target_steps
    e = energy_summary(result)
    assert e["backend"] == "rapl" and e["idle"]["seconds"] >= 0.2
    for mode in ("ar", "mlx-lm"):
        m = e["modes"][mode]
        assert m["seconds"] >= 0.2 and m["tokens"] >= 1
        assert m["joules"] == {"cpu": 0.0}  # the fixture's counter did not move
        assert m["joules_per_token"] == 0.0


def _restricted_draft(vocab: int, head: list[int]) -> DraftNet:
    mx.random.seed(3)
    net = DraftNet(DraftConfig(hidden_size=64, num_layers=2, intermediate_size=128,
                               num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=vocab,
                               embed_size=64, head_tokens=head, shared_embedding=False))
    mx.eval(net.parameters())
    return net


def test_mlx_lm_draft_adapter_restricted_head():
    head = [5, 17, 2, 40, 33]
    net = _restricted_draft(64, head)
    draft = MLXLMDraft(net)
    tokens = mx.array([[1, 9, 4, 7, 3, 12]])
    cache = draft.make_cache()
    draft(tokens[:, :5], cache)
    step = draft(tokens[:, 5:], cache)[0, -1]
    whole = draft(tokens)[0, -1]
    np.testing.assert_allclose(np.array(step), np.array(whole), rtol=1e-4, atol=1e-4)
    own = np.array(net(tokens)[0, -1])
    full = np.array(whole)
    assert full.shape == (64,)
    np.testing.assert_allclose(full[head], own, rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.delete(full, head)))
    assert int(full.argmax()) == head[int(own.argmax())]


def test_mlx_lm_speculative_through_the_adapter_is_lossless(target):
    head = list(range(0, target.vocab_size, 7))
    draft = MLXLMDraft(_restricted_draft(target.vocab_size, head))
    prompt = mx.array(target.tokenizer.encode("The capital of France is"))
    plain = [t for t, _ in generate_step(prompt, target.model, max_tokens=6)]
    spec = [t for t, _, _ in speculative_generate_step(prompt, target.model, draft,
                                                        num_draft_tokens=2, max_tokens=6)]
    assert spec == plain


def _run(mode, qid, tps, turn=0):
    r = Run(mode, qid, "qa", turn, 0, [1, 2, 3, 4], 1, 0.1, 0.1 + 3 / tps, GenerationStats())
    assert r.decode_tokens_per_second == pytest.approx(tps)
    return r


def test_speedups_pair_runs_of_the_same_prompt_turn_and_repeat():
    runs = [_run("ar", "a", 10.0), _run("ar", "b", 20.0), _run("mirror", "b", 30.0),
            _run("mirror", "a", 25.0), _run("mlx-lm-sd", "a", 12.5), _run("ar", "a", 5.0, 1)]
    metrics = run_metrics(runs)
    assert metrics[2]["speedup_vs_ar"] == pytest.approx(1.5)
    assert metrics[3]["speedup_vs_ar"] == pytest.approx(2.5)
    assert metrics[3]["speedup_vs_mlx_lm_sd"] == pytest.approx(2.0)
    assert metrics[2]["speedup_vs_mlx_lm_sd"] is None  # no mlx-lm SD run of "b"
    assert metrics[5]["speedup_vs_ar"] == pytest.approx(1.0)
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([None]) is None


def test_transfers_across_ranks_per_token():
    """The bench's account of transfers between ranks: the probe's time per step over the
    tokens each step committed, so a mode that commits more per step pays less per token."""
    def ranked(mode, steps, tokens, decode_s):
        return Run(mode, "a", "qa", 0, 0, [1] * tokens, 1, 0.1, 0.1 + decode_s, GenerationStats(
            target_steps=steps, committed_tokens=tokens, decode_s=decode_s, ranks=2,
            parallel="pipeline", split=[15, 15], comm_s=0.002))
    out = ranks_summary(SimpleNamespace(runs=[ranked("ar", 10, 10, 1.0),
                                              ranked("sd", 4, 10, 0.6)]))
    assert out["ar"]["comm_ms_per_token"] == pytest.approx(2.0)
    assert out["sd"]["comm_ms_per_token"] == pytest.approx(0.8)
    assert out["ar"]["comm_share"] == pytest.approx(0.02)
    assert out["sd"]["comm_share"] == pytest.approx(0.008 / 0.6)
    assert ranks_summary(SimpleNamespace(runs=[_run("ar", "a", 10.0)])) == {}
