"""Distillation data from a file of the target's own replies (`distill --replies`), labelled by
the real default target."""

import json

from mirror_mlx.api import Engine
from mirror_mlx.cli import main
from mirror_mlx.errors import DataFileError, InvalidParameter
from mirror_mlx.train import feature
from mirror_mlx.train.data import load_data
from mirror_mlx.train.distill import TrainConfig, examples, train_draft
from mirror_mlx.train.replies import Replies, _records, replies_data, write_replies

import mlx.core as mx
import numpy as np
import pytest

QUESTIONS = ["Name two oceans.", "What is 2 + 3?", "Say hello in French.",
             "Give me a word that rhymes with cat."]


@pytest.fixture(scope="module")
def replies(target, tmp_path_factory):
    """Prompts in the chat template; greedy replies by the project's own decoding (8 tokens),
    and one made-up reply standing in for a sampled one."""
    with Engine(target, mode="ar") as engine:
        prompts = [engine.encode(q) for q in QUESTIONS]
        greedy = [(i, engine.generate(p, max_tokens=8).token_ids) for i, p in enumerate(prompts)]
    made_up = target.tokenizer.encode("Rivers, mostly.", add_special_tokens=False)
    path = tmp_path_factory.mktemp("replies") / "replies.npz"
    write_replies(path, prompts, {"greedy": greedy, "t08": [(2, made_up)]})
    return path, prompts, greedy, made_up


def _arrays(folder):
    return [{k: v.copy() for k, v in s.items()} for s in load_data(folder)]


def test_labels_are_the_targets_own_top_k_at_every_reply_position(replies, target, tmp_path):
    path, prompts, greedy, made_up = replies
    paths = replies_data(target, path, tmp_path, shard_size=2)
    shards = load_data(paths)
    assert len(shards) == 3 and paths == sorted((tmp_path / "data").glob("shard-*.npz"))
    # The sets in turn: greedy 0, the sampled one (prompt 2), then the other greedy replies.
    expected = [(prompts[0], greedy[0][1], 0.0), (prompts[2], made_up, 0.8),
                (prompts[1], greedy[1][1], 0.0), (prompts[2], greedy[2][1], 0.0),
                (prompts[3], greedy[3][1], 0.0)]
    items = examples(shards, 384)
    assert len(items) == 5
    for item, (prompt, reply, _) in zip(items, expected):
        assert item.tokens.tolist() == prompt + reply and item.first == len(prompt)
        # One forward of the whole record by hand: position t predicts token t + 1.
        logits = target.model(mx.array([prompt + reply]))[0].astype(mx.float32)
        logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        by_hand = logp[len(prompt) - 1 : -1]
        assert item.top_ids.shape == (len(reply), 8) and item.top_ids.dtype == np.int32
        assert (item.top_ids[:, 0] == by_hand.argmax(-1)).all()
        assert np.allclose(item.top_logp, np.take_along_axis(by_hand, item.top_ids, -1),
                           atol=1e-2, rtol=2e-3)
        assert (np.diff(item.top_logp.astype(np.float32), axis=-1) <= 0).all()
    # Greedy replies are the target's best tokens, so the labels' first choices spell them.
    for item, (_, reply, temp) in zip(items, expected):
        if temp == 0.0:
            assert item.top_ids[:, 0].tolist() == reply
    temps = np.concatenate([s["temperature"] for s in shards]).tolist()
    assert temps == pytest.approx([t for _, _, t in expected])


def test_a_stopped_run_resumes_at_the_first_missing_shard(replies, target, tmp_path):
    path = replies[0]
    paths = replies_data(target, path, tmp_path, count=4, shard_size=2)
    whole = _arrays(paths)
    first, second = paths
    kept = first.stat().st_mtime_ns
    second.unlink()  # as if stopped after the first shard
    assert replies_data(target, path, tmp_path, count=4, shard_size=2) == paths
    assert first.stat().st_mtime_ns == kept  # not redone
    again = _arrays(paths)
    assert len(again) == len(whole) == 2
    for a, b in zip(whole, again):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # Fewer or more replies go on from the same shards: the first N are the same whatever the
    # total; only a last shard cut short by the count is labelled again.
    fewer = replies_data(target, path, tmp_path, count=3, shard_size=2)
    assert fewer == paths and first.stat().st_mtime_ns == kept
    assert [len(s["prompt_len"]) for s in load_data(fewer)] == [2, 1]
    more = replies_data(target, path, tmp_path, count=5, shard_size=2)
    assert more[:2] == paths and first.stat().st_mtime_ns == kept
    assert [len(s["prompt_len"]) for s in load_data(more)] == [2, 2, 1]
    for a, b in zip(whole, _arrays(more)):
        assert all((a[k] == b[k]).all() for k in a)
    # Other arguments on the same folder are refused, naming what changed.
    with pytest.raises(InvalidParameter, match="sets: .*greedy"):
        replies_data(target, path, tmp_path, sets=("greedy",), count=4, shard_size=2)
    with pytest.raises(InvalidParameter, match="seq_len: 384 then, 256 now"):
        replies_data(target, path, tmp_path, count=4, shard_size=2, seq_len=256)


def test_features_come_with_the_labels_from_the_whole_record(replies, target, tmp_path,
                                                             monkeypatch):
    """With feature layers, each shard carries the target's features over the training
    window (mapped, not read), computed with the whole record as context: what the draft reads
    when it runs, not what the window alone would give; training takes them as they are. A
    token draft's run takes the same data."""
    path, layers = replies[0], [3, 15, 25]
    paths = replies_data(target, path, tmp_path, seq_len=40, shard_size=2, taps=layers)
    shards = load_data(paths)
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["features"] == layers
    # A run for a token draft (no layers) takes the same folder as it is, features and all.
    assert replies_data(target, path, tmp_path, seq_len=40, shard_size=2) == paths
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["features"] == layers
    assert isinstance(shards[0]["features"], np.memmap)
    records = [s["tokens"][a:b] for s in shards
               for a, b in zip(s["offsets"][:-1], s["offsets"][1:])]
    cut = 0
    for item, whole in zip(examples(shards, 40), records, strict=True):
        start = len(whole) - len(item.tokens)  # replies end where the window does
        assert (whole[start:] == item.tokens).all()
        by_hand = feature.target_features(target, [whole], layers)[0]
        assert item.features.shape == (len(item.tokens) - 1, 3 * 576)
        np.testing.assert_allclose(item.features.astype(np.float32),
                                   by_hand[start:-1].astype(np.float32), rtol=2e-2, atol=2e-2)
        if start:
            cut += 1
            alone = feature.target_features(target, [item.tokens], layers)[0]
            assert np.abs(alone[:-1].astype(np.float32) - item.features).max() > 1.0
    assert cut  # some windows start inside their prompt, where context changes the features
    # A longer window than the data's cannot be trained on: its first rows were not computed.
    with pytest.raises(InvalidParameter, match="features cover a shorter window"):
        examples(shards, 64)
    # A draft reading those layers trains on the stored features, without a pass of its own.
    monkeypatch.setattr(feature, "target_features",
                        lambda *a, **k: pytest.fail("features computed again"))
    cfg = TrainConfig(layers=1, head_tokens=256, seq_len=40, batch=2, epochs=1, holdout=0.2,
                      features=layers, warmup=1)
    report = train_draft(target, shards, tmp_path, cfg)
    assert report["steps"] == 2 and report["positions"] > 0
    assert (tmp_path / "draft" / "weights.safetensors").exists()


def test_replies_as_their_own_labels_need_no_forward(replies, target, tmp_path, monkeypatch):
    """--labels replies: each reply token is its own label at probability 1, without a forward
    of the target; a token draft trains on it, and agreement is scored on the greedy replies
    only (a sampled token is not the target's best). A feature draft is refused: there is no
    forward to give it features."""
    path, prompts, greedy, made_up = replies
    monkeypatch.setattr("mirror_mlx.train.replies.teacher_forced",
                        lambda *a, **k: pytest.fail("the target ran"))
    paths = replies_data(target, path, tmp_path, shard_size=2, labels="replies")
    items = examples(load_data(paths), 384)
    expected = [(greedy[0][1], True), (made_up, False), (greedy[1][1], True),
                (greedy[2][1], True), (greedy[3][1], True)]
    for item, (reply, scored) in zip(items, expected, strict=True):
        assert item.top_ids[:, 0].tolist() == reply and item.scored == scored
        assert (item.top_logp[:, 0] == 0).all() and np.isneginf(item.top_logp[:, 1:]).all()
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["labels"] == "replies"
    # The target's labels are other data: the same folder refuses them.
    with pytest.raises(InvalidParameter, match="labels: replies then, target now"):
        replies_data(target, path, tmp_path, shard_size=2)
    with pytest.raises(InvalidParameter, match="no forward of the target"):
        replies_data(target, path, tmp_path / "f", shard_size=2, labels="replies", taps=[3])
    # Four of the five held out (holdout 0.8); only the greedy ones are scored: the made-up
    # reply's tokens would count against a draft that does not write them.
    cfg = TrainConfig(layers=1, head_tokens=1024, seq_len=64, batch=1, epochs=1, holdout=0.8,
                      warmup=1, seed=1)
    report = train_draft(target, load_data(paths), tmp_path, cfg)
    held = examples(load_data(paths), 64)
    np.random.default_rng(1).shuffle(held)
    assert not all(e.scored for e in held[:4])
    assert report["positions"] == sum(len(e.top_ids) for e in held[:4] if e.scored)


def _write(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_a_wrong_file_gets_a_clear_error(target, tmp_path):
    good = dict(prompt_flat=np.array([1, 2, 3]), prompt_lens=np.array([2, 1]),
                greedy_flat=np.array([5, 6, 7]), greedy_lens=np.array([2, 1]),
                greedy_prompt_index=np.array([0, 1]))
    out = tmp_path / "out"
    cases = [
        ({k: v for k, v in good.items() if k != "greedy_lens"}, "lacks greedy_lens"),
        ({**good, "prompt_lens": np.array([2, 2])}, "prompt_lens must be positive and add up"),
        ({**good, "greedy_prompt_index": np.array([0])}, "one integer per reply"),
        ({**good, "greedy_prompt_index": np.array([0, 2])}, "must name rows of the 2 prompts"),
        ({**good, "greedy_flat": np.array([5, 6, 10**6])}, "token ids must be in 0..49151"),
        ({**good, "greedy_flat": np.array([5.0, 6.0, 7.0])}, "1-D array of integers"),
    ]
    for i, (arrays, message) in enumerate(cases):
        path = _write(tmp_path / f"bad{i}.npz", **arrays)
        with pytest.raises(DataFileError, match=message):
            replies_data(target, path, out, sets=("greedy",))
    # The t08 set is asked for by default and this file has none.
    with pytest.raises(DataFileError, match="lacks t08_flat"):
        replies_data(target, _write(tmp_path / "good.npz", **good), out)
    (tmp_path / "text.npz").write_text("not an archive")
    with pytest.raises(DataFileError, match="not an npz file"):
        replies_data(target, tmp_path / "text.npz", out)
    with pytest.raises(InvalidParameter, match="--sets takes one or more of greedy, t08"):
        replies_data(target, tmp_path / "good.npz", out, sets=("t07",))
    assert not (out / "data" / "meta.json").exists()  # nothing was claimed


def test_cli_makes_the_data_only(replies, tmp_path, capsys):
    path = replies[0]
    out = tmp_path / "work"
    assert main(["distill", "--replies", str(path), "--out", str(out), "--data-only",
                 "--sets", "greedy", "--conversations", "2", "--features", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 2 and report["shards"] == 1
    assert report["response_tokens"] == sum(len(r) for _, r in replies[2][:2])
    assert not (out / "draft").exists() and not (out / "checkpoint").exists()
    assert main(["distill", "--replies", str(tmp_path / "none.npz"), "--out", str(out),
                 "--data-only"]) == 1
    assert "replies file not found" in capsys.readouterr().err


def test_records_keep_what_training_reads_within_the_context():
    prompts = [np.arange(10), np.arange(100, 600)]
    replies = Replies(prompts, {"greedy": [np.arange(1000, 1300)], "t08": [np.arange(2000, 2030)]},
                      {"greedy": np.array([0]), "t08": np.array([1])})
    (p0, r0, t0), (p1, r1, t1) = _records(replies, [("greedy", 0), ("t08", 0)], seq_len=64,
                                          context=520)
    # A short prompt: training reads the first 64 tokens, so the reply stops at 54.
    assert (p0 == prompts[0]).all() and (r0 == np.arange(1000, 1054)).all() and t0 == 0.0
    # The whole reply fits after 32 prompt tokens; the prompt loses its head to the context.
    assert (r1 == np.arange(2000, 2030)).all() and t1 == 0.8
    assert (p1 == np.arange(110, 600)).all() and len(p1) + len(r1) == 520
