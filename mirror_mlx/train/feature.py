"""Training a feature-conditioned draft (draft/net.py): the target's features for the training
text, and the training-time test.

Data labelled from replies (`distill --replies`) carries the features, computed in the same
forward as the labels with each record's whole context, in files that training maps into memory:
tens of thousands of replies fit, and a draft learns the features it will read when it runs. For
sampled data they are recomputed from the stored tokens (one pass of the target's first layers
over each training window, kept in memory as float16). Each
layer's feature is kept divided by its root mean square: the draft reads it through an RMS norm
(DraftNet.fused), which that scale does not change, and Gemma's residual stream outgrows
float16's range (past 65,504 from the 8th of Gemma 3 270M's 18 layers).

Training-time test (EAGLE-3): at inference only the first drafted token of a step reads the
target's features; the later ones read the draft's own last hidden state. So the loss also
unrolls the draft on itself: pass k feeds every position t the hidden state pass k - 1 produced
at t - 1, and attends as the k-th drafted token of a step does: to the target-fed keys up to
t - k and to the keys of passes 1..k at t - k + 1 .. t (each its own drafted predecessor).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..draft.load import target_info
from ..draft.net import DraftConfig, DraftNet, llama_source
from ..models import split
from ..models.load import LoadedModel
from ..progress import Progress

UNROLL_DECAY = 0.8  # weight of pass k's loss: later drafted tokens matter less (fewer reach them)


def default_feature_layers(num_layers: int) -> list[int]:
    """A low, a middle and a late layer, all at or below Mirror-SD's default exit (5/6 of the
    depth): then a branch rollout can read the window's real features at the early exit."""
    late = max(1, round(num_layers * 5 / 6))
    return sorted({max(1, num_layers // 8), max(1, num_layers // 2), late})


def init_feature_draft(target: LoadedModel, layers: int, head_tokens: list[int],
                       feature_layers: list[int]) -> DraftNet:
    """A draft of `layers` decoder layers as wide as the target, started as the target's first
    layers reading the token embedding alone (the mix passes the embedding through and weighs
    the features by little at first), with a head of the target's embedding rows for
    `head_tokens`: a sane next-token model from the first step, which learns to read."""
    args = target.model.args
    config = DraftConfig.like(args, layers, head_tokens=head_tokens,
                              feature_layers=feature_layers, feature_size=args.hidden_size,
                              target=target_info(target))
    net = DraftNet(config)
    source = llama_source(target.model, layers)
    weights = [(f"layers.{i}.{k}", v) for i in range(layers)
               for k, v in tree_flatten(source.layers[i].parameters())]
    width = args.hidden_size
    mix = mx.concatenate([0.1 * net.mix.weight[:, :width], mx.eye(width)], axis=1)
    # The target's final norm is scaled for its last layer's output, far larger than one
    # layer's: taken as is, it makes the first predictions confidently wrong (cross entropy
    # 16 against 7.5 at a third of it, on the default target).
    weights += [("norm.weight", 0.3 * source.norm.weight), ("mix.weight", mix),
                ("head.weight", target.model.model.embed_tokens.weight[mx.array(head_tokens)])]
    net.load_weights(weights, strict=False)
    net.embed_tokens = target.model.model.embed_tokens
    net.embed_tokens.freeze()
    mx.eval(net.parameters())
    return net


def target_features(target: LoadedModel, token_lists: list[np.ndarray], layers: list[int],
                    batch: int = 8, progress: Progress | None = None,
                    raw: bool = False) -> list[np.ndarray]:
    """Per token list (T,), the target's outputs of `layers` after each token, each divided by
    its root mean square, concatenated: (T, len(layers) * hidden) float16 (what training
    stores: a draft of ours norms each feature first, so the scale is not needed). `raw`: the
    states as the decoders hand them to a draft, float32 (an EAGLE-3 head's fc reads them
    unnormed). Lists are run in batches of similar length (padding at the end changes nothing
    before it under a causal mask)."""
    model = target.model
    out: list[np.ndarray | None] = [None] * len(token_lists)
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    for at in range(0, len(order), batch):
        group = order[at : at + batch]
        width = max(len(token_lists[i]) for i in group)
        x = np.zeros((len(group), width), np.int32)
        for r, i in enumerate(group):
            x[r, : len(token_lists[i])] = token_lists[i]
        p = split.start(model, mx.array(x), [None] * len(model.layers), layers)
        split.run_layers(model, p, 0, max(layers))
        feats = mx.concatenate(p.features, axis=-1) if raw else stored(p.features)
        mx.eval(feats)
        feats = np.array(feats)
        for r, i in enumerate(group):
            out[i] = feats[r, : len(token_lists[i])]
        if progress:
            progress.advance(sum(len(token_lists[i]) for i in group))
    return out


def stored(features: list[mx.array]) -> mx.array:
    """The target's states at several layers as training keeps them: each divided by its root
    mean square, concatenated, float16."""
    return mx.concatenate([f * mx.rsqrt(mx.mean(f * f, axis=-1, keepdims=True) + 1e-12)
                           for f in features], axis=-1).astype(mx.float16)


def split_features(net: DraftNet, f: mx.array) -> list[mx.array]:
    size = net.config.feature_size
    return [f[..., i * size : (i + 1) * size] for i in range(len(net.config.feature_layers))]


def input_features(net: DraftNet, f: mx.array) -> mx.array:
    """The features of tokens 0..T-1 from the target's features after them (B, T, F): token t
    reads the target after t - 1; token 0 reads nothing (zeros)."""
    g = net.fused(split_features(net, f.astype(mx.float32)))
    return mx.concatenate([mx.zeros_like(g[:, :1]), g[:, :-1]], axis=1)


class _Prefixed:
    """A layer's 'cache' during the unroll: the keys and values of earlier passes first."""

    def __init__(self, keys: list, values: list):
        self.keys, self.values = keys, values

    @property
    def offset(self) -> int:
        """The keys held before this pass's (an EAGLE-3 head's mask reads it)."""
        return sum(k.shape[2] for k in self.keys)

    def update_and_fetch(self, k, v):
        self.keys.append(k)
        self.values.append(v)
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)


def _unroll_mask(T: int, k: int) -> mx.array:
    """Pass k's attention over the keys of passes 0..k (T each): position t sees pass 0 up to
    t - k and pass j at t - k + j."""
    q = mx.arange(T)[:, None]
    p = mx.arange(T)[None]
    blocks = [p <= q - k] + [p == q - (k - j) for j in range(1, k + 1)]
    return mx.concatenate(blocks, axis=1)[None, None]


def unrolled_logits(net: DraftNet, x: mx.array, f: mx.array, passes: int,
                    rows: list[mx.array] | None = None) -> list[mx.array]:
    """Logits of each pass of the training-time test (pass 0 reads the target's features):
    (B, T, head) each, or, with `rows`, pass k's at the flat positions rows[k] only (the head
    is most of a small draft's cost: training reads it out only where there are labels)."""
    B, T = x.shape
    keys = [[] for _ in net.layers]
    values = [[] for _ in net.layers]
    features = input_features(net, f)
    out = []
    for k in range(passes):
        caches = [_Prefixed(keys[i], values[i]) for i in range(len(net.layers))]
        mask = "causal" if k == 0 else _unroll_mask(T, k)
        top = net.top(x, 0, mask, caches, features)
        if rows is None:
            out.append(net.logits(net.norm(top)))
        else:
            out.append(net.logits(net.norm(top.reshape(B * T, -1)[rows[k]])))
        # The next pass's token t was drafted from this pass's state at t - 1.
        features = mx.concatenate([mx.zeros_like(top[:, :1]), top[:, :-1]], axis=1)
    return out


def passes_over_text(target: LoadedModel, net: DraftNet, ids: list[int],
                     passes: int) -> list[mx.array]:
    """A draft's logits (1, T, head) at every position of `ids` as the 1st, 2nd, ... token of
    a step: the unrolled passes for a draft that reads the target's features (the target's
    states over the same text, unnormed as the decoders hand them), one forward for each pass
    for a draft that reads tokens only. What benchmarks score a draft by over written text."""
    if not net.reads_features:
        return [net(mx.array([ids]))] * passes
    f = target_features(target, [np.array(ids)], net.config.feature_layers, raw=True)[0]
    return unrolled_logits(net, mx.array([ids]), mx.array(f[None]), passes)


def labelled_rows(tw: mx.array, passes: int) -> list[mx.array]:
    """Per pass k, the flat positions with labels where pass k applies: t >= k (pass k at t
    stands for the k-th drafted token after t - k)."""
    B, T = tw.shape[:2]
    has = np.array(tw.sum(-1) > 0)
    return [mx.array(np.flatnonzero(np.pad(has[:, k:], ((0, 0), (k, 0))).reshape(-1)))
            for k in range(passes)]


def unrolled_loss(net: DraftNet, x, f, tid, tw, passes: int, soft_ce) -> mx.array:
    rows = labelled_rows(tw, passes)
    flat_id, flat_w = tid.reshape(-1, tid.shape[-1]), tw.reshape(-1, tw.shape[-1])
    total = weight = 0.0
    for k, logits in enumerate(unrolled_logits(net, x, f, passes, rows)):
        w = UNROLL_DECAY**k
        total = total + w * soft_ce(logits, flat_id[rows[k]], flat_w[rows[k]])
        weight += w
    return total / weight


def feature_agreement(net: DraftNet, batches, passes: int) -> dict:
    """Held-out top-1 agreement with the target per unrolled pass (pass 0: target features).
    Where the target's best token is one the head cannot produce, it counts as a miss (as in
    distill.agreement)."""
    hits = np.zeros(passes)
    total = np.zeros(passes)
    for x, f, tid, tw in batches:
        valid = tw.sum(-1) > 0
        top = tw[..., 0] >= tw.max(-1)  # the first soft target is the target's best token
        for k, logits in enumerate(unrolled_logits(net, x, f, passes)):
            pred = mx.argmax(logits, axis=-1)
            ok = (pred == tid[..., 0]) & valid & top
            hits[k] += int(ok[:, k:].sum())
            total[k] += int(valid[:, k:].sum())
    rates = hits / np.maximum(total, 1)
    return {"top1_agreement": float(rates[0]),
            "top1_agreement_by_pass": [round(float(r), 4) for r in rates],
            "positions": int(total[0])}


def nn_value_and_grad(net: DraftNet, passes: int, soft_ce):
    return nn.value_and_grad(
        net, lambda n, x, f, tid, tw: unrolled_loss(n, x, f, tid, tw, passes, soft_ce))
