"""Distillation data produced by the target itself: responses sampled from it, with its top-k
log-probabilities at every response position (the soft labels a draft learns from).

Generation is batched with continuous refill (finished rows leave the batch, new prompts join
it), so the CPU works on full batches. Data is written in shards of `SHARD` conversations,
under a manifest written first (meta.json: the target, the prompts' hash, the arguments); a run
that is interrupted resumes at the first missing shard, here or on another machine, and one
with other arguments is refused. The prompts of shard i depend only on the seed and i, so a
resumed run produces the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from ..errors import InvalidParameter
from ..models import split
from ..models.load import LoadedModel
from ..progress import Progress
from .prompts import PromptSpec, make_prompts

SHARD = 96
TOP_K = 8
# Mostly greedy and low-temperature responses: greedy decoding is what the draft must predict
# best; some hotter samples widen the contexts it sees.
TEMPERATURES = (0.0, 0.0, 0.0, 0.3, 0.7, 1.0)


@dataclass
class Sample:
    response: list[int]
    top_ids: np.ndarray  # (len(response), TOP_K) int32: target's best tokens at each position
    top_logp: np.ndarray  # (len(response), TOP_K) float16: their log-probabilities


def sample_batch(model, prompts: list[list[int]], temps: list[float], max_new: int,
                 eos: frozenset[int], rng: np.random.Generator, batch: int = 32,
                 progress: Progress | None = None) -> list[Sample]:
    """Sample a response to each prompt, keeping the target's top-k log-probs."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    queue = list(order)
    done: dict[int, Sample] = {}
    rows: list[dict] = []
    cache, logits = None, None
    while queue or rows:
        if queue and len(rows) <= batch // 2:
            take, queue = queue[: batch - len(rows)], queue[batch - len(rows):]
            width = max(len(prompts[i]) for i in take)
            pads = [width - len(prompts[i]) for i in take]
            fresh = [BatchKVCache(pads) for _ in model.layers]
            padded = mx.array([[0] * p + prompts[i] for p, i in zip(pads, take)])
            # The output layer at the last position only: over every prompt position it would
            # be batch x width x vocabulary floats (gigabytes for Gemma's 262,144 tokens).
            new_logits = split.lm_head(model, model.model(padded, cache=fresh)[:, -1])
            if cache is None:
                cache, logits = fresh, new_logits
            else:
                for c, f in zip(cache, fresh):
                    c.extend(f)
                logits = mx.concatenate([logits, new_logits])
            rows += [{"index": i, "tokens": [], "ids": [], "logp": []} for i in take]
        logp = logits.astype(mx.float32) - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argpartition(-logp, TOP_K - 1, axis=-1)[:, :TOP_K]
        top_lp = mx.take_along_axis(logp, top, axis=-1)
        t = mx.array([max(temps[r["index"]], 1e-6) for r in rows])[:, None]
        greedy = mx.array([temps[r["index"]] == 0.0 for r in rows])
        key = mx.array(rng.integers(0, 2**31, size=2).astype(np.uint32))
        sampled = mx.random.categorical(logp / t, key=key)
        tokens = mx.where(greedy, mx.argmax(logp, axis=-1), sampled)
        tokens, top, top_lp = (np.array(a) for a in (tokens, top, top_lp))
        keep = []
        for j, r in enumerate(rows):
            tok = int(tokens[j])
            order_k = np.argsort(-top_lp[j])
            r["ids"].append(top[j][order_k])
            r["logp"].append(top_lp[j][order_k])
            r["tokens"].append(tok)
            if tok in eos or len(r["tokens"]) >= max_new:
                done[r["index"]] = Sample(r["tokens"], np.array(r["ids"], np.int32),
                                          np.array(r["logp"], np.float16))
                if progress:
                    progress.advance(len(r["tokens"]))
            else:
                keep.append(j)
        if len(keep) < len(rows):
            rows = [rows[j] for j in keep]
            if not rows:
                cache, logits = None, None
                continue
            idx = mx.array(keep)
            for c in cache:
                c.filter(idx)
            tokens = tokens[keep]
        logits = model(mx.array(tokens)[:, None], cache=cache)[:, -1]
    return [done[i] for i in range(len(prompts))]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    if tokenizer.chat_template is None:
        # A completion model (a base model such as Gemma 3 270M) continues the turns as text.
        return tokenizer.encode("\n\n".join(m["content"] for m in messages) + "\n\n")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def make_shard(target: LoadedModel, specs: list[PromptSpec], seed: int, max_new: int,
               batch: int, progress: Progress | None) -> dict:
    """All records of one shard: passages first, then the prompts, then follow-up turns."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    tok, eos, model = target.tokenizer, target.eos_token_ids, target.model
    records = []  # (prompt ids, Sample, temperature)

    def run(conversations: list[list[dict]]) -> list[Sample]:
        temps = [pick.choice(TEMPERATURES) for _ in conversations]
        prompts = [_chat_ids(tok, c) for c in conversations]
        out = sample_batch(model, prompts, temps, max_new, eos, rng, batch, progress)
        records.extend(zip(prompts, out, temps))
        return out

    needs = [s for s in specs if s.passage_request]
    passages = run([[{"role": "user", "content": s.passage_request}] for s in needs])
    text_of = {id(s): tok.decode(p.response, skip_special_tokens=True)
               for s, p in zip(needs, passages)}
    firsts = [[{"role": "user", "content": s.text.replace("{passage}", text_of.get(id(s), ""))}]
              for s in specs]
    replies = run(firsts)
    follow = [(c, s, r) for c, s, r in zip(firsts, specs, replies) if s.follow_up]
    run([c + [{"role": "assistant", "content": tok.decode(r.response, skip_special_tokens=True)},
              {"role": "user", "content": s.follow_up}] for c, s, r in follow])

    tokens, offsets, prompt_len, temps, ids, logp = [], [0], [], [], [], []
    for prompt, sample, temp in records:
        tokens += prompt + sample.response
        offsets.append(len(tokens))
        prompt_len.append(len(prompt))
        temps.append(temp)
        ids.append(sample.top_ids)
        logp.append(sample.top_logp)
    return {
        "tokens": np.array(tokens, np.int32), "offsets": np.array(offsets, np.int64),
        "prompt_len": np.array(prompt_len, np.int32), "temperature": np.array(temps, np.float32),
        "top_ids": np.concatenate(ids), "top_logp": np.concatenate(logp),
    }


def generate_data(target: LoadedModel, out: Path, conversations: int, seed: int = 0,
                  max_new: int = 256, batch: int = 32,
                  prompts: list[PromptSpec] | None = None) -> Path:
    """Write `conversations` sampled conversations (plus passages and follow-ups) under
    out/data/, from `prompts` (else generated ones). Returns that folder. Resumes where an
    earlier run stopped."""
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    specs = (prompts or make_prompts(conversations, seed))[:conversations]
    digest = hashlib.sha256(json.dumps([dataclasses.astuple(s) for s in specs]).encode())
    claim(folder, {"source": "sampled", "target": Path(target.name).name,
                   "conversations": len(specs), "prompts_sha256": digest.hexdigest(),
                   "seed": seed, "top_k": TOP_K, "max_new": max_new})
    shards = [specs[i : i + SHARD] for i in range(0, len(specs), SHARD)]
    todo = [i for i in range(len(shards)) if not (folder / f"shard-{i:05d}.npz").exists()]
    # A prompt is sampled once, plus once for its passage and once for its follow-up turn;
    # responses average ~140 tokens. The estimate only drives the ETA.
    records = sum(1 + bool(s.passage_request) + bool(s.follow_up) for i in todo for s in shards[i])
    progress = Progress("sampling", records * 140, unit="tok")
    for i in todo:
        write_shard(folder / f"shard-{i:05d}.npz",
                    make_shard(target, shards[i], seed * 100_003 + i, max_new, batch, progress))
    progress.close()
    return folder


def manifest(folder: Path) -> dict | None:
    """The manifest of the data in `folder` (meta.json), None where none is written yet."""
    path = folder / "meta.json"
    return json.loads(path.read_text()) if path.exists() else None


def claim(folder: Path, meta: dict) -> None:
    """Write the manifest of the data a run makes in `folder`, or check that the one there
    describes the same work (a run resumes only what the same arguments began)."""
    old = manifest(folder)
    if old is not None:
        if old != meta:
            diff = "; ".join(f"{k}: {old.get(k)} then, {meta.get(k)} now"
                             for k in sorted(set(old) | set(meta)) if old.get(k) != meta.get(k))
            raise InvalidParameter(
                f"{folder} holds data made with other arguments ({diff}); run with the same "
                f"arguments to resume, or use another --out")
    elif any(folder.glob("shard-*.npz")):
        raise InvalidParameter(f"{folder} holds data without a manifest (an older version's); "
                               f"use another --out")
    else:
        tmp = folder / ".meta.json"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.rename(folder / "meta.json")


def write_shard(path: Path, data: dict) -> None:
    """A shard, atomically: it exists whole or not at all, so a run resumes at the first one
    missing. The target's features, where there are any, go to a file of their own first
    (path with .features.npy), which training maps into memory instead of reading."""
    data = dict(data)
    features = data.pop("features", None)
    if features is not None:
        _atomic(path.with_suffix(".features.npy"), lambda f: np.save(f, features))
    _atomic(path, lambda f: np.savez(f, **data))


def _atomic(path: Path, write) -> None:
    tmp = path.with_name("." + path.name)
    with open(tmp, "wb") as f:
        write(f)
    tmp.rename(path)


def shard_paths(data: Path | Sequence[Path]) -> list[Path]:
    """A data folder's shards, in order, or the shards given."""
    return sorted(data.glob("shard-*.npz")) if isinstance(data, Path) else list(data)


def load_data(data: Path | Sequence[Path]) -> list[dict]:
    """The shards of a data folder (or the shards given); features (where stored) mapped, not
    read."""
    shards = []
    for path in shard_paths(data):
        shard = dict(np.load(path))
        if "feature_offsets" in shard:
            shard["features"] = np.load(path.with_suffix(".features.npy"), mmap_mode="r")
        shards.append(shard)
    return shards
