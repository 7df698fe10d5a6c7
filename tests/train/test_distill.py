"""Distillation end to end on a tiny configuration with the real default target."""

from mirror_mlx.api import Engine
from mirror_mlx.cli import main
from mirror_mlx.draft.base import Job
from mirror_mlx.draft.load import SHIPPED_DRAFT, load_draft, load_folder
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.draft.net import DraftNet
from mirror_mlx.errors import InvalidParameter
from mirror_mlx.models import split
from mirror_mlx.train.data import generate_data, load_data
from mirror_mlx.train.distill import TrainConfig, head_vocabulary, rehead, train_draft
from mirror_mlx.train.feature import default_feature_layers
from mirror_mlx.train.prompts import PromptSpec

import mlx.core as mx
import numpy as np
import pytest


@pytest.fixture(scope="module")
def samples(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    folder = generate_data(target, out, conversations=16, seed=3, max_new=24, batch=8)
    return out, load_data(folder)


def test_samples_hold_target_top_k(samples, target):
    _, shards = samples
    s = shards[0]
    n_resp = int((s["offsets"][1:] - s["offsets"][:-1] - s["prompt_len"]).sum())
    assert s["top_ids"].shape == (n_resp, 8) and s["top_logp"].shape == (n_resp, 8)
    # Log-probs are sorted, best first, and greedy rows (temperature 0) took the best token.
    assert (s["top_logp"][:, :-1] >= s["top_logp"][:, 1:]).all()
    pos = 0
    for r, temp in enumerate(s["temperature"]):
        a, b = s["offsets"][r] + s["prompt_len"][r], s["offsets"][r + 1]
        if temp == 0:
            assert (s["tokens"][a:b] == s["top_ids"][pos : pos + b - a, 0]).all()
        pos += b - a


def test_a_run_resumes_only_its_own_data(samples, target):
    """The manifest is written first: the same arguments find every shard made (nothing is
    sampled again), other arguments are refused before anything is sampled."""
    out, shards = samples
    folder = generate_data(target, out, conversations=16, seed=3, max_new=24, batch=8)
    assert len(load_data(folder)) == len(shards)
    with pytest.raises(InvalidParameter, match="seed: 3 then, 4 now"):
        generate_data(target, out, conversations=16, seed=4, max_new=24, batch=8)
    with pytest.raises(InvalidParameter, match="prompts_sha256"):
        generate_data(target, out, conversations=16, seed=3, max_new=24, batch=8,
                      prompts=[PromptSpec("user", "Say hi.")] * 16)


def test_training_lowers_the_loss_and_resumes(samples, target):
    out, shards = samples
    cfg = TrainConfig(layers=1, head_tokens=1024, seq_len=96, batch=4, epochs=3, lr=2e-3,
                      warmup=2, holdout=0.1)
    report = train_draft(target, shards, out, cfg)
    assert report["steps"] >= 6
    assert report["final_loss"] < report["first_loss"]
    net = DraftNet.load(out / "draft", embedding=target.model.model.embed_tokens)
    assert net.config.num_layers == 1 and len(net.config.head_tokens) == 1024
    # More epochs pick up from the checkpoint instead of starting over.
    more = train_draft(target, shards, out, TrainConfig(**{**cfg.__dict__, "epochs": 4}))
    assert more["steps"] > report["steps"]
    assert more["first_loss"] < report["first_loss"]


def test_training_continues_from_the_shipped_drafts(samples, target):
    out, shards = samples
    cfg = TrainConfig(seq_len=96, batch=4, epochs=1, warmup=2, holdout=0.1)
    fresh = train_draft(target, shards, out / "fresh", cfg)
    for shipped in ("default", "default-tokens"):
        more = train_draft(target, shards, out / shipped, TrainConfig(**{**cfg.__dict__,
                                                                         "init": shipped}))
        # It starts where the shipped draft's training ended, far below a fresh start.
        assert more["first_loss"] < fresh["first_loss"] - 0.5, (shipped, more, fresh)
        net = DraftNet.load(out / shipped / "draft", embedding=target.model.model.embed_tokens)
        assert net.config.head_tokens == head_vocabulary(shards, 8192, target.vocab_size)


def test_a_draft_trained_further_takes_the_head_its_new_data_calls_for(target):
    """Its rows for the tokens it keeps, the target's embedding rows for new ones; scores
    follow the new head's order."""
    net = load_folder(SHIPPED_DRAFT, target, dtype="float32")
    shipped = list(net.config.head_tokens)
    learnt = dict(zip(shipped, np.array(net.head.weight)))
    new = sorted(shipped[:5] + [t for t in range(target.vocab_size) if t not in learnt][:3])
    rehead(net, new, target)
    assert net.config.head_tokens == new and net.head_ids.tolist() == new
    embed = np.array(target.model.model.embed_tokens.weight)
    for t, row in zip(new, np.array(net.head.weight)):
        assert (row == (learnt[t] if t in learnt else embed[t])).all()
    assert net.logits(mx.ones((1, net.config.hidden_size))).shape == (1, len(new))


def test_speculative_streams_train_and_draft_several_tokens_per_forward(samples, target):
    out, shards = samples
    cfg = TrainConfig(layers=1, head_tokens=1024, seq_len=96, batch=4, epochs=3, lr=2e-3,
                      warmup=2, holdout=0.1, streams=2)
    report = train_draft(target, shards, out / "streams", cfg)
    assert report["final_loss"] < report["first_loss"]
    folder = out / "streams" / "draft"
    drafter = MLXDrafter(load_draft(str(folder), target))
    try:
        prompt = target.tokenizer.encode("Tell me about rivers.")
        result = drafter.submit(Job([prompt], 7)).result()
        assert len(result.rollouts[0].tokens) == 7
        assert result.forwards == 3  # 1 + 2 streams per forward
    finally:
        drafter.close()
    # Lossless whatever the draft proposes.
    with Engine(target, mode="sd", draft=str(folder), gamma=5) as engine:
        got = engine.generate("Name two oceans.", max_tokens=16).token_ids
    assert got == Engine(target, mode="ar").generate("Name two oceans.", max_tokens=16).token_ids


def test_a_feature_draft_trains_with_its_own_features_and_decodes_losslessly(samples, target):
    out, shards = samples
    layers = default_feature_layers(target.num_layers)
    cfg = TrainConfig(layers=1, head_tokens=1024, seq_len=96, batch=4, epochs=2, lr=2e-3,
                      warmup=2, holdout=0.1, features=layers, unroll=2)
    report = train_draft(target, shards, out / "features", cfg)
    assert report["final_loss"] < report["first_loss"]
    assert len(report["top1_agreement_by_pass"]) == 2  # the target's features, then its own
    folder = out / "features" / "draft"
    net = load_draft(str(folder), target)
    assert net.reads_features and net.config.feature_layers == layers
    with Engine(target, mode="sd", draft=str(folder)) as engine:  # adaptive length
        result = engine.generate("Name two oceans.", max_tokens=16)
    assert result.token_ids == Engine(target, mode="ar").generate("Name two oceans.",
                                                       max_tokens=16).token_ids
    assert sum(result.stats.draft_lengths.values()) == result.stats.target_steps


def test_distill_exit_keeps_the_shallowest_layer_that_reaches_the_goal(samples, target, capsys):
    out, _ = samples
    head_file = out / "exit.safetensors"
    # Every trained candidate reaches a goal of 1%: the shallowest (half the depth) is kept.
    assert main(["distill-exit", "--data", str(out), "--out", str(head_file),
                 "--coverage", "0.01", "--positions", "400"]) == 0
    table = capsys.readouterr().out
    assert "trained top-1/4/8" in table
    head = split.ExitHead.load(head_file, target.model.args.hidden_size, target.num_layers)
    assert head.layer == target.num_layers // 2
    # A named layer is trained whatever the goal; a goal outside (0, 1] is refused.
    assert main(["distill-exit", "--data", str(out), "--out", str(head_file), "--layer", "20",
                 "--coverage", "1", "--positions", "400"]) == 0
    assert split.ExitHead.load(head_file, target.model.args.hidden_size,
                               target.num_layers).layer == 20
    assert main(["distill-exit", "--data", str(out), "--out", str(head_file),
                 "--coverage", "80"]) == 1
    assert "--coverage must be in (0, 1]" in capsys.readouterr().err
