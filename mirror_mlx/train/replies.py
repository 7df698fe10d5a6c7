"""Distillation data from replies the target already wrote (`distill --replies FILE`).

Sampling is the slow part of making data on a CPU (one forward per token); replies sampled once
elsewhere (a faster machine, another framework) leave only the soft labels to compute here. One
teacher-forced forward of prompt + reply gives the target's top-k log-probabilities at every
reply position: what `data.sample_batch` records while it samples, had it written that reply.
They are computed again rather than taken from the file because the loss needs the target's own
numbers (a reply sampled on other hardware may break a float near-tie the other way).

The records are written in data.py's shard format (load_data and training read them unchanged),
atomically, with a manifest (meta.json), so a run resumes at the first missing shard, on this
machine or another; a run with other arguments on the same folder is refused.

The file is an npz of token ids in flat arrays with per-row lengths:
  prompt_flat, prompt_lens: each prompt as the target's chat template makes it;
  {set}_flat, {set}_lens, {set}_prompt_index: the replies of a set ("greedy": temperature 0,
  "t08": 0.8) and the prompt row each one answers.
`write_replies` writes one.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import DataFileError, InvalidParameter
from ..models import split
from ..models.default import sha256
from ..models.load import LoadedModel
from ..progress import Progress
from . import feature
from .data import TOP_K, claim, manifest, write_shard
from .distill import PROMPT_TAIL, window

SETS = {"greedy": 0.0, "t08": 0.8}  # name in the file -> temperature the replies were sampled at
# Where the labels come from: the target's top-k by a teacher-forced forward of each record, or
# the reply tokens themselves, one-hot (no forward: minutes instead of hours on a CPU, for a
# draft that reads tokens only; a greedy reply is the target's argmax, a sampled one a sample
# of its distribution, which cross entropy against it estimates without bias).
LABELS = ("target", "replies")
SHARD_SIZE = 128  # records a shard: a few minutes of work on a 2-core CPU, so little is lost
BATCH_TOKENS = 4096  # padded tokens a forward
HEAD_CHUNK = 512  # positions an output-layer call: Gemma 3's 262,144 logits a position add up


@dataclass
class Replies:
    prompts: list[np.ndarray]
    replies: dict[str, list[np.ndarray]]  # set -> reply token ids
    prompt_index: dict[str, np.ndarray]  # set -> the prompt row each reply answers


def _rows(data, name: str, flat_key: str, lens_key: str, vocab: int, path: Path) -> list:
    flat, lens = data[flat_key], data[lens_key]
    for key, a in ((flat_key, flat), (lens_key, lens)):
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise DataFileError(f"{path}: {key} must be a 1-D array of integers "
                                f"(got {a.dtype} of shape {a.shape})")
    if (lens < 1).any() or int(lens.sum()) != len(flat):
        raise DataFileError(f"{path}: {lens_key} must be positive and add up to the length of "
                            f"{flat_key} ({int(lens.sum())} != {len(flat)})")
    if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise DataFileError(f"{path}: {name} token ids must be in 0..{vocab - 1} (the target's "
                            f"vocabulary); is the file for another target?")
    return np.split(flat.astype(np.int32), np.cumsum(lens)[:-1])


def read_replies(path: Path, sets: Sequence[str], vocab: int) -> Replies:
    """The prompts and the replies of `sets`, checked against each other and the vocabulary."""
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataFileError(f"replies file not found: {path}") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DataFileError(f"{path} is not an npz file of replies ({e})") from None
    with data:
        needed = ["prompt_flat", "prompt_lens"] + [f"{s}_{part}" for s in sets
                                                   for part in ("flat", "lens", "prompt_index")]
        missing = [k for k in needed if k not in data.files]
        if missing:
            raise DataFileError(
                f"{path} lacks {', '.join(missing)}: a replies file holds prompt_flat and "
                f"prompt_lens, and for each set S of {', '.join(sets)}: S_flat, S_lens and "
                f"S_prompt_index")
        prompts = _rows(data, "prompt", "prompt_flat", "prompt_lens", vocab, path)
        replies, index = {}, {}
        for s in sets:
            replies[s] = _rows(data, s, f"{s}_flat", f"{s}_lens", vocab, path)
            index[s] = data[f"{s}_prompt_index"]
            if index[s].shape != (len(replies[s]),) or not np.issubdtype(index[s].dtype,
                                                                         np.integer):
                raise DataFileError(f"{path}: {s}_prompt_index must hold one integer per reply "
                                    f"({len(replies[s])}), got shape {index[s].shape}")
            if len(index[s]) and not (0 <= index[s].min() and index[s].max() < len(prompts)):
                raise DataFileError(f"{path}: {s}_prompt_index must name rows of the "
                                    f"{len(prompts)} prompts")
    return Replies(prompts, replies, index)


def write_replies(path: Path, prompts: Sequence[Sequence[int]],
                  replies: dict[str, Sequence[tuple[int, Sequence[int]]]]) -> None:
    """A replies file: prompt token ids, and per set a list of (prompt row, reply token ids)."""
    def flat(rows):
        return {"flat": np.array([t for r in rows for t in r], np.uint32),
                "lens": np.array([len(r) for r in rows], np.int32)}

    arrays = {f"prompt_{k}": v for k, v in flat(prompts).items()}
    for s, pairs in replies.items():
        arrays.update({f"{s}_{k}": v for k, v in flat([r for _, r in pairs]).items()})
        arrays[f"{s}_prompt_index"] = np.array([i for i, _ in pairs], np.int32)
    np.savez_compressed(path, **arrays)


def interleave(replies: Replies, sets: Sequence[str]) -> list[tuple[str, int]]:
    """(set, reply) in the order they are worked through: the sets in turn, so that any prefix
    of the work (a run stopped early, --conversations N) holds as much of each."""
    longest = max(len(replies.replies[s]) for s in sets)
    return [(s, k) for k in range(longest) for s in sets if k < len(replies.replies[s])]


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (int32) and float32 log-probs along the last axis, best first: split.top_k's
    numbers, in NumPy, whose exp, sum and partition over a vocabulary run ~10x faster than
    MLX's on a CPU (they were most of the time here)."""
    ids = np.argpartition(logits, -k, axis=-1)[:, -k:]
    top = np.take_along_axis(logits, ids, axis=-1)
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    order = np.argsort(-top, axis=-1)
    return (np.take_along_axis(ids, order, axis=-1).astype(np.int32),
            np.take_along_axis(top, order, axis=-1) - lse)


def teacher_forced(model, records: list[tuple[np.ndarray, np.ndarray]],
                   batch_tokens: int = BATCH_TOKENS, progress: Progress | None = None,
                   taps: Sequence[int] = (), starts: Sequence[int] = ()) -> list[tuple]:
    """The target's top-k ids (int32) and log-probs (float16), best first, predicting each reply
    token of each (prompt, reply): position t of prompt + reply predicts token t + 1. With
    `taps`, also the target's states after those layers (feature.stored) at positions
    starts[i] .. of record i's input (None without). Rows of similar length share a forward,
    padded on the right (a causal mask keeps the padding out of every real position)."""
    inputs = [np.concatenate([p, r[:-1]]) for p, r in records]
    order = sorted(range(len(records)), key=lambda i: len(inputs[i]))
    out: dict[int, tuple] = {}
    while order:
        group = [order.pop(0)]  # ascending lengths: the last row taken sets the padded width
        while order and (len(group) + 1) * len(inputs[order[0]]) <= batch_tokens:
            group.append(order.pop(0))
        width = len(inputs[group[-1]])
        x = np.zeros((len(group), width), np.int32)
        where = []
        for b, i in enumerate(group):
            x[b, : len(inputs[i])] = inputs[i]
            first = len(records[i][0]) - 1
            where.append(b * width + np.arange(first, len(inputs[i])))
        # Final-normed hidden states, as sample_batch reads them; where features are tapped,
        # the layers one by one (split computes what the model's own forward does).
        feats = None
        if taps:
            p = split.start(model, mx.array(x), [None] * len(model.model.layers), taps)
            h = model.model.norm(split.run_layers(model, p, 0, len(model.model.layers)))
            feats = np.array(feature.stored(p.features))
        else:
            h = model.model(mx.array(x))
        h = h.reshape(-1, h.shape[-1])[mx.array(np.concatenate(where))]
        ids, logp = [], []
        for at in range(0, h.shape[0], HEAD_CHUNK):
            logits = split.lm_head(model, h[at : at + HEAD_CHUNK]).astype(mx.float32)
            top_ids, top_lp = top_k(np.array(logits), TOP_K)
            ids.append(top_ids)
            logp.append(top_lp.astype(np.float16))
        ids, logp = np.concatenate(ids), np.concatenate(logp)
        at = 0
        for b, (i, w) in enumerate(zip(group, where)):
            rows = None if feats is None else feats[b, starts[i] : len(inputs[i])]
            out[i] = ids[at : at + len(w)], logp[at : at + len(w)], rows
            at += len(w)
        if progress:
            progress.advance(sum(len(inputs[i]) for i in group))
    return [out[i] for i in range(len(records))]


def _records(replies: Replies, picks: list[tuple[str, int]], seq_len: int,
             context: int) -> list[tuple]:
    """(prompt, reply, temperature) of each pick, the reply cut where training stops reading:
    a record longer than seq_len is trained on from PROMPT_TAIL tokens before its reply
    (distill.window), so what lies past that costs a forward and is never read. The prompt is
    kept whole, as the target's labels must see the context the reply was written in, unless
    the record outgrows the target's context: then its end, as much as fits."""
    out = []
    for s, k in picks:
        prompt = replies.prompts[int(replies.prompt_index[s][k])]
        reply = replies.replies[s][k]
        _, end = window(len(prompt), len(prompt) + len(reply), seq_len)
        reply = reply[: end - len(prompt)]
        prompt = prompt[max(0, len(prompt) + len(reply) - context):]
        out.append((prompt, reply, SETS[s]))
    return out


def _work(prompt: np.ndarray, reply: np.ndarray) -> int:
    return len(prompt) + len(reply) - 1  # tokens a teacher-forced forward reads


def make_shard(model, records: list[tuple], batch_tokens: int = BATCH_TOKENS,
               progress: Progress | None = None, taps: Sequence[int] = (),
               seq_len: int = 384) -> dict:
    """One shard in data.py's format. With `taps`, also the target's features (under
    "features"; data.py writes them to a file of their own) over each record's training window
    (distill.window at `seq_len`), computed with the record's whole context: a window cut out of
    it would give them other values than the draft reads when it runs."""
    starts = [window(len(p), len(p) + len(r), seq_len)[0] for p, r, _ in records]
    labels = teacher_forced(model, [(p, r) for p, r, _ in records], batch_tokens, progress,
                            taps, starts)
    shard = {**_record_arrays(records),
             "top_ids": np.concatenate([i for i, _, _ in labels]),
             "top_logp": np.concatenate([lp for _, lp, _ in labels])}
    if taps:
        rows = [f for _, _, f in labels]
        shard["feature_layers"] = np.array(taps, np.int32)
        shard["feature_start"] = np.array(starts, np.int64)
        shard["feature_offsets"] = np.concatenate(
            [[0], np.cumsum([len(f) for f in rows])]).astype(np.int64)
        shard["features"] = np.concatenate(rows)
    return shard


def one_hot_shard(records: list[tuple]) -> dict:
    """One shard in data.py's format whose labels are the replies' own tokens: the first of the
    top-k columns holds the token at log-probability 0, the others nothing (-inf)."""
    shard = _record_arrays(records)
    tokens = np.concatenate([r for _, r, _ in records]).astype(np.int32)
    shard["top_ids"] = np.repeat(tokens[:, None], TOP_K, axis=1)
    shard["top_logp"] = np.full((len(tokens), TOP_K), -np.inf, np.float16)
    shard["top_logp"][:, 0] = 0
    shard["one_hot"] = np.array(True)
    return shard


def _record_arrays(records: list[tuple]) -> dict:
    tokens = [np.concatenate([p, r]) for p, r, _ in records]
    return {
        "tokens": np.concatenate(tokens).astype(np.int32),
        "offsets": np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64),
        "prompt_len": np.array([len(p) for p, _, _ in records], np.int32),
        "temperature": np.array([t for _, _, t in records], np.float32),
    }


def replies_data(target: LoadedModel, path: Path, out: Path,
                 sets: Sequence[str] = tuple(SETS), count: int | None = None,
                 seq_len: int = 384, shard_size: int = SHARD_SIZE,
                 batch_tokens: int = BATCH_TOKENS, taps: Sequence[int] = (),
                 labels: str = "target") -> list[Path]:
    """Label the first `count` replies of `sets` from the file at `path` (all when None) with
    the target's top-k, and with its features at the layers `taps` where given, or (`labels`
    "replies") with their own tokens, into shards under out/data/. Returns those shards' paths.
    Resumes where an earlier run stopped, with the same count or another."""
    unknown = [s for s in sets if s not in SETS]
    if not sets or unknown or len(set(sets)) != len(sets):
        raise InvalidParameter(f"--sets takes one or more of {', '.join(SETS)}, each once "
                               f"(got '{','.join(sets)}')")
    if count is not None and count < 1:
        raise InvalidParameter(f"--conversations must be at least 1 (got {count})")
    if not PROMPT_TAIL < seq_len <= target.context_length:
        raise InvalidParameter(f"--seq-len must be in {PROMPT_TAIL + 1}..{target.context_length}"
                               f" (the target's context; got {seq_len})")
    if shard_size < 1 or batch_tokens < 1:
        raise InvalidParameter("shard_size and batch_tokens must be positive")
    if labels not in LABELS:
        raise InvalidParameter(f"--labels takes {' or '.join(LABELS)} (got '{labels}')")
    if labels == "replies" and taps:
        raise InvalidParameter("--labels replies makes no forward of the target, so it has no "
                               "features to give: train a draft that reads tokens only "
                               "(--features none), or label with the target")
    replies = read_replies(path, sets, target.vocab_size)
    picks = interleave(replies, sets)[:count]
    if not picks:
        raise DataFileError(f"{path} holds no replies of {', '.join(sets)}")
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    if not taps and labels == "target":  # the labels do not depend on the features beside
        # them: data made for a feature draft serves a token draft as it is, and its next
        # shards keep the features
        taps = (manifest(folder) or {}).get("features", [])
    claim(folder, {"source": "replies", "file": path.name, "sha256": sha256(path),
                   "target": Path(target.name).name, "sets": list(sets),
                   "top_k": TOP_K, "shard_size": shard_size, "seq_len": seq_len,
                   "features": list(taps), "labels": labels})
    shards = [picks[i : i + shard_size] for i in range(0, len(picks), shard_size)]
    names = [folder / f"shard-{i:05d}.npz" for i in range(len(shards))]
    records = [_records(replies, s, seq_len, target.context_length) for s in shards]
    done = [_holds(name, len(recs)) for name, recs in zip(names, records)]
    if labels == "replies":
        for recs, name, d in zip(records, names, done):
            if not d:
                write_shard(name, one_hot_shard(recs))
        return names
    work = [sum(_work(p, r) for p, r, _ in recs) for recs in records]
    progress = Progress("teacher forcing", sum(work), unit="tok",
                        done=sum(w for w, d in zip(work, done) if d))
    for recs, name, d in zip(records, names, done):
        if not d:
            write_shard(name, make_shard(target.model, recs, batch_tokens, progress, taps,
                                         seq_len))
    progress.close()
    return names


def _holds(shard: Path, records: int) -> bool:
    """Whether a shard is written with all its records: the count is not part of a run's
    manifest (the first N replies are the same whatever the total), so a run may stop and go on
    with more or fewer; only its last shard can then hold fewer records than asked, and is
    labelled again."""
    if not shard.exists():
        return False
    with np.load(shard) as s:
        return len(s["prompt_len"]) == records
