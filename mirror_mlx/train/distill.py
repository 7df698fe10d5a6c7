"""Distil a draft from a target's own samples (`mirror-mlx distill`).

The draft starts as the target's first layers, its final norm, and an output layer restricted
to the tokens the target actually writes most (rows of the target's embedding): the LM head
dominates a small model's cost (PLATFORM.md), and a restricted head cuts it several-fold. The
input embedding stays the target's (shared, frozen, not stored). Training minimizes the cross
entropy between the target's top-k distribution (renormalized over the tokens the head can
produce) and the draft's, on response positions only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..draft.load import SHIPPED_DRAFTS, load_folder, target_info
from ..draft.net import DraftConfig, DraftNet, llama_source
from ..errors import InvalidParameter, ModelLoadError
from ..models.load import LoadedModel
from ..progress import Progress
from . import feature
from .prompts import PromptSpec


@dataclass
class TrainConfig:
    layers: int = 3
    head_tokens: int = 8192
    seq_len: int = 384
    batch: int = 8
    epochs: float = 2.0
    lr: float = 3e-4
    warmup: int = 50
    seed: int = 0
    holdout: float = 0.02
    streams: int = 0  # speculative streaming: extra tokens predicted per draft forward
    # A saved draft (folder, or "default" for the shipped one) to train further instead of
    # starting from the target's layers: distillation then spans runs on fresh data (another
    # seed), each as long as a session allows. Its layers, head size and streams are kept; its
    # head's tokens are chosen again from the new data (distill.rehead).
    init: str | None = None
    # A feature-conditioned draft (draft/net.py): the target layers it reads ("auto": a low, a
    # middle and a late one), and the passes of its training-time test (train/feature.py).
    features: list[int] | None = None
    unroll: int = 3
    minutes: float | None = None  # stop training (and save) after this long


@dataclass
class Example:
    tokens: np.ndarray  # prompt + response, cropped to seq_len
    first: int  # index in `tokens` of the first response token
    top_ids: np.ndarray  # (len(tokens) - first, k): target's top tokens predicting each one
    top_logp: np.ndarray
    # The target's features (feature.stored) after each input token, computed with the whole
    # record before the window as context, where the data holds them (a mapped file's rows).
    features: np.ndarray | None = None
    feature_layers: tuple[int, ...] = ()  # the target layers `features` hold
    # Whether the labels' first token is the target's best one, so agreement can be scored on
    # them: not where they are a sampled reply's own tokens (replies.one_hot_shard).
    scored: bool = True


PROMPT_TAIL = 32


def window(first: int, length: int, seq_len: int) -> tuple[int, int]:
    """The part [start, end) of a record (its response begins at `first`) that training reads:
    the end of the prompt (at least PROMPT_TAIL tokens of it) and as much response as fits."""
    start = max(0, min(first - PROMPT_TAIL, length - seq_len))
    return start, min(length, start + seq_len)


def examples(shards: list[dict], seq_len: int) -> list[Example]:
    out = []
    for s in shards:
        pos = 0
        one_hot = bool(s.get("one_hot", False))
        for r in range(len(s["prompt_len"])):
            a, b = int(s["offsets"][r]), int(s["offsets"][r + 1])
            n_resp = b - a - int(s["prompt_len"][r])
            ids, lp = s["top_ids"][pos : pos + n_resp], s["top_logp"][pos : pos + n_resp]
            pos += n_resp
            toks = s["tokens"][a:b]
            first = len(toks) - n_resp
            start, end = window(first, len(toks), seq_len)
            keep = end - first
            feats, layers = None, ()
            if "features" in s:  # rows from the data's own window start, which may be earlier
                at = start - int(s["feature_start"][r])
                if at < 0:
                    raise InvalidParameter(
                        f"the data's features cover a shorter window than --seq-len {seq_len}; "
                        f"train with the --seq-len the data was made with, or less")
                f0 = int(s["feature_offsets"][r]) + at
                feats = s["features"][f0 : f0 + end - start - 1]
                layers = tuple(int(n) for n in s["feature_layers"])
            out.append(Example(toks[start:end], first - start, ids[:keep], lp[:keep], feats,
                               layers, not (one_hot and s["temperature"][r] > 0)))
    return out


def head_vocabulary(shards: list[dict], size: int, vocab: int) -> list[int]:
    """The `size` tokens the target writes most (counted over its top-1 and sampled tokens)."""
    counts = np.zeros(vocab, np.int64)
    for s in shards:
        np.add.at(counts, s["top_ids"][:, 0], 1)
        np.add.at(counts, s["tokens"], 1)
    return sorted(int(i) for i in np.argsort(-counts)[:size])


def rehead(net: DraftNet, head: list[int], target: LoadedModel) -> None:
    """Give a draft trained further the head this data calls for (the tokens its target writes
    most here, which text of another kind changes): the rows it learnt for the tokens it keeps,
    the target's embedding rows (as a fresh draft starts) for the others."""
    old = {t: i for i, t in enumerate(net.config.head_tokens)}
    rows = target.model.model.embed_tokens.weight[mx.array(head)].astype(net.head.weight.dtype)
    kept = [j for j, t in enumerate(head) if t in old]
    if kept:
        rows[mx.array(kept)] = net.head.weight[mx.array([old[head[j]] for j in kept])]
    net.set_head(head, rows)
    mx.eval(net.head.parameters())


def head_positions(head: list[int], vocab: int) -> np.ndarray:
    """Token id -> its index in the draft's head, -1 for tokens the head cannot produce."""
    index = np.full(vocab, -1, np.int64)
    index[np.array(head, np.int64)] = np.arange(len(head))
    return index


def init_draft(target: LoadedModel, layers: int, head_tokens: list[int],
               streams: int = 0) -> DraftNet:
    """The target's first `layers` layers, final norm and (restricted) tied head, as copies.
    A target whose layers are not of the plain llama form (Gemma 3) gives only its head rows:
    the layers start from MLX's random initialization."""
    args = target.model.args
    config = DraftConfig.like(args, layers, head_tokens=head_tokens, stream_count=streams,
                              target=target_info(target))
    net = DraftNet(config)
    try:
        source = llama_source(target.model, layers)
        weights = {k: v for k, v in tree_flatten(source.parameters())
                   if k.startswith(("layers.", "norm."))}
    except ModelLoadError:  # layers of another form (Gemma 3's norms, qk-norm): start random
        weights = {}
    embed = target.model.model.embed_tokens
    weights["head.weight"] = embed.weight[mx.array(head_tokens)]
    net.load_weights(list(weights.items()), strict=False)
    net.embed_tokens = embed
    net.embed_tokens.freeze()
    mx.eval(net.parameters())
    return net


def _batches(items: list[Example], batch: int, seq_len: int, head_index: np.ndarray,
             rng: np.random.Generator, features: list[np.ndarray] | None = None):
    order = rng.permutation(len(items))
    for at in range(0, len(order) - batch + 1, batch):
        pick = order[at : at + batch]
        x, tid, tw = _collate([items[i] for i in pick], seq_len, head_index)
        if features is None:
            yield x, tid, tw
        else:
            yield x, _stack([features[i] for i in pick], x.shape[1]), tid, tw


def _stack(features: list[np.ndarray], length: int) -> mx.array:
    """Features of a batch's input positions, zero-padded to `length`."""
    out = np.zeros((len(features), length, features[0].shape[-1]), np.float16)
    for b, f in enumerate(features):
        n = min(len(f), length)
        out[b, :n] = f[:n]
    return mx.array(out)


def _collate(group: list[Example], seq_len: int, head_index: np.ndarray):
    """Inputs (B, L), soft targets over head indices (B, L, k) with weights, and a mask."""
    k = group[0].top_ids.shape[1]
    L = min(seq_len, max(len(e.tokens) for e in group)) - 1
    x = np.zeros((len(group), L), np.int32)
    tid = np.zeros((len(group), L, k), np.int32)
    tw = np.zeros((len(group), L, k), np.float32)
    for b, e in enumerate(group):
        n = min(len(e.tokens) - 1, L)
        x[b, :n] = e.tokens[:n]
        # Position t predicts token t + 1; response token j sits at first + j.
        for j in range(len(e.top_ids)):
            t = e.first + j - 1
            if not 0 <= t < n:
                continue
            idx = head_index[e.top_ids[j]]
            p = np.exp(e.top_logp[j].astype(np.float32)) * (idx >= 0)
            if p.sum() > 0:
                tid[b, t] = np.maximum(idx, 0)
                tw[b, t] = p / p.sum()
    return mx.array(x), mx.array(tid), mx.array(tw)


def _soft_ce(logits, tid, tw):
    """Cross entropy against soft targets (weights `tw` over head indices `tid`), averaged
    over the positions that have targets."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    per_pos = -(mx.take_along_axis(logp, tid, axis=-1) * tw).sum(-1)
    mask = tw.sum(-1) > 0
    return (per_pos * mask).sum() / mx.maximum(mask.sum(), 1)


STREAM_WEIGHT = 0.1  # MIRROR_SD.md section 4: loss = CE(next) + 0.1 * sum_j CE(token t + j)


def _loss(net: DraftNet, x, tid, tw):
    if not net.config.stream_count:
        return _soft_ce(net(x), tid, tw)
    main, streams = net.hidden_with_streams(x, 0, "causal")
    loss = _soft_ce(net.logits(main), tid, tw)
    for j in range(1, net.config.stream_count + 1):
        # Stream j after position t predicts the token that position t + j predicts.
        loss = loss + STREAM_WEIGHT * _soft_ce(net.logits(streams[:, :-j, j - 1]),
                                                tid[:, j:], tw[:, j:])
    return loss


def agreement(net: DraftNet, items: list[Example], head_index: np.ndarray,
              seq_len: int) -> dict:
    """Held-out agreement: how often the draft's best token is the target's best token (over
    the items whose labels say which that is)."""
    items = [e for e in items if e.scored]
    hit = total = 0
    for at in range(0, len(items), 8):
        x, tid, tw = _collate(items[at : at + 8], seq_len, head_index)
        pred = mx.argmax(net(x), axis=-1)
        target_top = tid[..., 0]
        valid = tw.sum(-1) > 0
        # The first soft target is the target's argmax when it lies in the head vocabulary.
        is_top = tw[..., 0] >= tw.max(-1)
        hit += int(((pred == target_top) & valid & is_top).sum())
        total += int(valid.sum())
    return {"top1_agreement": hit / max(total, 1), "positions": total}


def features_of(target: LoadedModel, items: list[Example], layers: list[int]
                ) -> list[np.ndarray]:
    """The target's features at `layers` for each example's input: the data's own where it
    holds those layers, else one pass over the examples' tokens (kept in memory)."""
    if all(e.feature_layers == tuple(layers) for e in items):
        return [e.features for e in items]
    progress = Progress("target features", sum(len(e.tokens) for e in items), unit="tok")
    out = feature.target_features(target, [e.tokens for e in items], layers, progress=progress)
    progress.close()
    return out


def train_draft(target: LoadedModel, shards: list[dict], out: Path, cfg: TrainConfig) -> dict:
    """Train and save a draft under out/draft; resumes from out/checkpoint when present."""
    if cfg.layers < 1 or cfg.layers >= target.num_layers:
        raise InvalidParameter(f"--layers must be in 1..{target.num_layers - 1}")
    rng = np.random.default_rng(cfg.seed)
    mx.random.seed(cfg.seed)
    items = examples(shards, cfg.seq_len)
    rng.shuffle(items)
    n_hold = max(1, int(len(items) * cfg.holdout))
    held, items = items[:n_hold], items[n_hold:]
    if len(items) < cfg.batch:
        raise InvalidParameter(f"only {len(items)} training examples; generate more data")
    if cfg.init:
        net = load_folder(SHIPPED_DRAFTS.get(cfg.init, Path(cfg.init)), target,
                          dtype="float32")  # stored 8-bit weights are widened to train
        net.embed_tokens.freeze()
        if net.config.head_tokens and not net.config.tie_head:
            rehead(net, head_vocabulary(shards, len(net.config.head_tokens), target.vocab_size),
                   target)
        head = list(net.config.head_tokens)
    elif cfg.features:
        head = head_vocabulary(shards, cfg.head_tokens, target.vocab_size)
        net = feature.init_feature_draft(target, cfg.layers, head, cfg.features)
    else:
        head = head_vocabulary(shards, cfg.head_tokens, target.vocab_size)
        net = init_draft(target, cfg.layers, head, cfg.streams)
    head_index = head_positions(head, target.vocab_size)
    feats = held_feats = None
    if net.reads_features:
        feats = features_of(target, items, net.config.feature_layers)
        held_feats = features_of(target, held, net.config.feature_layers)

    steps_per_epoch = len(items) // cfg.batch
    total = max(1, int(steps_per_epoch * cfg.epochs))
    schedule = optim.join_schedules(
        [optim.linear_schedule(cfg.lr * 0.01, cfg.lr, cfg.warmup),
         optim.cosine_decay(cfg.lr, max(1, total - cfg.warmup), cfg.lr * 0.05)],
        [cfg.warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    ckpt = out / "checkpoint"
    step = _resume(ckpt, net, opt)
    if net.reads_features:
        loss_and_grad = feature.nn_value_and_grad(net, cfg.unroll, _soft_ce)
    else:
        loss_and_grad = nn.value_and_grad(net, _loss)

    def update(*batch):
        loss, grads = loss_and_grad(net, *batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(net, grads)
        return loss

    progress = Progress("distilling", total, unit="step", done=step)
    epoch_rng = np.random.default_rng(cfg.seed + 1)
    done = 0
    ema = first = None
    started = time.perf_counter()
    while step < total:
        for batch in _batches(items, cfg.batch, cfg.seq_len, head_index, epoch_rng, feats):
            if done < step:  # fast-forward the data order after a resume
                done += 1
                continue
            loss = update(*batch)
            mx.eval(loss, net.parameters(), opt.state)
            step += 1
            done += 1
            first = float(loss) if first is None else first
            ema = float(loss) if ema is None else 0.95 * ema + 0.05 * float(loss)
            progress.advance(1, extra=f"loss {ema:.3f}")
            if step % 100 == 0 or step == total:
                _checkpoint(ckpt, net, opt, step)
            if step >= total:
                break
            if cfg.minutes and time.perf_counter() - started > 60 * cfg.minutes:
                _checkpoint(ckpt, net, opt, step)
                total = step  # out of time: what it has learnt so far is the draft
                break
    progress.close()
    if net.reads_features:
        quality = feature.feature_agreement(net, _batches(
            held, 1, cfg.seq_len, head_index, np.random.default_rng(0), held_feats), cfg.unroll)
    else:
        quality = agreement(net, held, head_index, cfg.seq_len)
    report = {"steps": step, "first_loss": first, "final_loss": ema,
              "train_seconds": time.perf_counter() - started,
              "examples": len(items), "head_tokens": len(head), **quality}
    net.save(out / "draft")
    (out / "draft" / "training.json").write_text(json.dumps(
        {"config": cfg.__dict__, **report}, indent=1))
    return report


def _checkpoint(folder: Path, net: DraftNet, opt, step: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(net.trainable_parameters()))
    state = {f"opt.{k}": v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(folder / "state.safetensors"), {**weights, **state},
                        metadata={"step": str(step)})


def _resume(folder: Path, net: DraftNet, opt) -> int:
    path = folder / "state.safetensors"
    if not path.exists():
        return 0
    tensors, meta = mx.load(str(path), return_metadata=True)
    net.load_weights([(k, v) for k, v in tensors.items() if not k.startswith("opt.")],
                     strict=False)
    state = tree_unflatten([(k[4:], v) for k, v in tensors.items() if k.startswith("opt.")])
    opt.init(net.trainable_parameters())
    opt.state = tree_map(lambda x: x, {**opt.state, **state})
    return int(meta["step"])



def run_distill(target: LoadedModel, out: Path, cfg: TrainConfig, conversations: int | None,
                max_new: int = 200, batch: int = 48, prompts: list[PromptSpec] | None = None,
                replies: Path | None = None, sets: tuple[str, ...] = ("greedy", "t08"),
                data_only: bool = False, labels: str = "target") -> dict:
    """Make the data (sampled from the target, or its `replies` labelled; resuming), then train
    and save the draft; with `data_only`, stop after the data and describe it."""
    from .data import generate_data, load_data
    from .replies import replies_data

    if replies is not None:
        data = replies_data(target, replies, out, sets, conversations, cfg.seq_len,
                            taps=cfg.features or (), labels=labels)
    else:
        data = generate_data(target, out, conversations or 4000, cfg.seed, max_new, batch,
                             prompts)
    if data_only:
        return data_summary(data)
    return train_draft(target, load_data(data), out, cfg)


def data_summary(data: Path | list[Path]) -> dict:
    """What a data folder (or the shards given) holds, read from the shards' small arrays
    only."""
    from .data import shard_paths

    records = tokens = 0
    shards = shard_paths(data)
    for path in shards:
        with np.load(path) as s:
            records += len(s["prompt_len"])
            tokens += int(s["offsets"][-1]) - int(s["prompt_len"].sum())
    return {"data": str(shards[0].parent) if shards else "", "shards": len(shards),
            "records": records, "response_tokens": tokens}
