"""Train the early-exit head (`mirror-mlx distill-exit`) and measure where to exit.

The head is a tuned lens: one linear map applied to the hidden state after layer l, before the
target's own final norm and LM head, trained so that the exit distribution matches the final
one (cross entropy against the final top-k distribution). Coverage, the share of positions
whose final token is in the exit's top-kappa, is what Mirror-SD's branch reuse depends on; it
is reported for the raw logit lens at many layers and for the trained heads, so that l_e is
chosen from data rather than fixed at N/2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..models import split
from ..models.load import LoadedModel
from ..progress import Progress
from .distill import Example

TOP = 64  # final-distribution tokens kept as soft targets


@dataclass
class Activations:
    hidden: dict[int, np.ndarray]  # layer -> (N, hidden) float32, after that layer
    top_ids: np.ndarray  # (N, TOP) the final distribution's best tokens
    top_logp: np.ndarray  # (N, TOP) their log-probabilities


def collect(target: LoadedModel, items: list[Example], layers: list[int],
            max_positions: int) -> Activations:
    """Hidden states after each of `layers` and the final distribution, at the positions
    that predict response tokens (the positions Mirror-SD's windows cover)."""
    model = target.model
    hidden = {layer: [] for layer in layers}
    ids, logp = [], []
    count = 0
    progress = Progress("collecting", max_positions, unit="pos")
    for e in items:
        if count >= max_positions:
            break
        toks = mx.array(e.tokens[None])
        p = split.start(model, toks, [None] * len(model.layers))
        keep = mx.arange(max(e.first - 1, 0), len(e.tokens) - 1)
        done = 0
        for layer in sorted(layers):
            split.run_layers(model, p, done, layer)
            done = layer
            # float32: Gemma's residual stream outgrows float16's range in its middle layers.
            hidden[layer].append(p.h[0, keep].astype(mx.float32))
        split.run_layers(model, p, done, len(model.layers))
        final = split.final_logits(model, p.h[0, keep])
        top_i, top_lp = split.top_k(final, TOP)
        mx.eval(top_i, top_lp, *(h[-1] for h in hidden.values()))
        ids.append(np.array(top_i))
        logp.append(np.array(top_lp))
        count += keep.size
        progress.advance(keep.size)
    progress.close()
    return Activations({k: np.concatenate([np.array(h) for h in v]) for k, v in hidden.items()},
                       np.concatenate(ids), np.concatenate(logp))


def coverage(model: nn.Module, h: np.ndarray, final_top: np.ndarray, head: split.ExitHead | None,
             ks=(1, 4, 8)) -> dict[int, float]:
    """Share of positions whose final argmax is in the exit's top-k, for each k."""
    hits = {k: 0 for k in ks}
    for at in range(0, len(h), 512):
        logits = split.exit_logits(model, mx.array(h[at : at + 512]).astype(mx.float32), head)
        best, _ = split.top_k(logits, max(ks))
        best = np.array(best)
        truth = final_top[at : at + 512, :1]
        for k in ks:
            hits[k] += int((best[:, :k] == truth).any(-1).sum())
    return {k: hits[k] / max(len(h), 1) for k in ks}


def train_head(model: nn.Module, layer: int, h: np.ndarray, top_ids: np.ndarray,
               top_logp: np.ndarray, epochs: int = 3, batch: int = 256, lr: float = 1e-3,
               seed: int = 0) -> split.ExitHead:
    head = split.ExitHead(layer, h.shape[1])
    p = np.exp(top_logp.astype(np.float32))
    p /= p.sum(-1, keepdims=True)
    rng = np.random.default_rng(seed)
    steps = epochs * (len(h) // batch)
    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, steps, lr * 0.05))

    def loss_fn(head, x, ids, w):
        logits = split.exit_logits(model, x, head)
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -(mx.take_along_axis(logq, ids, axis=-1) * w).sum(-1).mean()

    loss_and_grad = nn.value_and_grad(head, loss_fn)
    progress = Progress(f"exit head @ layer {layer}", steps, unit="step")
    for _ in range(epochs):
        order = rng.permutation(len(h))
        for at in range(0, len(order) - batch + 1, batch):
            i = order[at : at + batch]
            loss, grads = loss_and_grad(head, mx.array(h[i]).astype(mx.float32),
                                        mx.array(top_ids[i]), mx.array(p[i]))
            opt.update(head, grads)
            mx.eval(loss, head.parameters(), opt.state)
            progress.advance(1, extra=f"loss {float(loss):.3f}")
    progress.close()
    return head


def choose_exit(target: LoadedModel, items: list[Example], layer: int | None,
                kappa: int = 8, goal: float = 0.8, positions: int = 40_000,
                seed: int = 0) -> tuple[split.ExitHead, list[dict]]:
    """Train the head at `layer`, or (layer None) at several depths, keeping the shallowest
    whose held-out top-kappa coverage (the trained head's, or the raw lens's where that is
    better) reaches `goal` (else the best). Returns the head and a per-layer coverage table
    (raw logit lens and trained head)."""
    n = target.num_layers
    candidates = [layer] if layer else sorted({n // 2, 2 * n // 3, 3 * n // 4, 5 * n // 6})
    raw_layers = sorted(set(candidates) | set(range(max(1, n // 3), n, max(1, n // 10))))
    acts = collect(target, items, raw_layers, positions)
    split_at = int(len(acts.top_ids) * 0.9)
    model = target.model
    rows, heads = [], {}
    for lay in raw_layers:
        test_h = acts.hidden[lay][split_at:]
        ks = (1, 4, kappa)
        row = {"layer": lay, "raw": coverage(model, test_h, acts.top_ids[split_at:], None, ks)}
        if lay in candidates:
            head = train_head(model, lay, acts.hidden[lay][:split_at],
                              acts.top_ids[:split_at], acts.top_logp[:split_at], seed=seed)
            row["tuned"] = coverage(model, test_h, acts.top_ids[split_at:], head, ks)
            # Training starts from the raw lens (a zero map) and can end below it where hidden
            # states are large (Gemma's reach 1e5, and Adam's steps overshoot): keep the
            # better, so a head never costs coverage. A zero head is the raw lens.
            row["kept"] = "trained" if row["tuned"][kappa] > row["raw"][kappa] else "raw"
            heads[lay] = head if row["kept"] == "trained" else split.ExitHead(lay, test_h.shape[1])
        rows.append(row)
    tuned = [r for r in rows if "tuned" in r]

    def kept(r: dict) -> float:
        return max(r["tuned"][kappa], r["raw"][kappa])

    good = [r for r in tuned if kept(r) >= goal]
    pick = min(good, key=lambda r: r["layer"]) if good else max(tuned, key=kept)
    return heads[pick["layer"]], rows


def run_distill_exit(target: LoadedModel, data: Path, out: Path, layer: int | None,
                     kappa: int, conversations: int, seed: int = 0, goal: float = 0.8,
                     positions: int = 40_000) -> list[dict]:
    """Train an exit head from distillation data (sampled into `data` if it has none) and save
    it to `out`; returns the coverage table."""
    from .data import generate_data, load_data
    from .distill import examples

    folder = data / "data" if (data / "data").is_dir() else data
    if not any(folder.glob("shard-*.npz")):
        folder = generate_data(target, data, conversations, seed)
    items = examples(load_data(folder), 384)
    np.random.default_rng(seed).shuffle(items)
    head, table = choose_exit(target, items, layer, kappa, goal, positions, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    head.save(out)
    return table


def format_table(table: list[dict], kappa: int) -> str:
    head = f"top-1/4/{kappa}"
    lines = [f"{'layer':>5}  {'raw ' + head:>18}  {'trained ' + head:>22}  kept"]
    for row in table:
        raw = "/".join(f"{100 * v:.0f}%" for v in row["raw"].values())
        tuned = "/".join(f"{100 * v:.0f}%" for v in row["tuned"].values()) if "tuned" in row \
            else "-"
        lines.append(f"{row['layer']:>5}  {raw:>18}  {tuned:>22}  {row.get('kept', '')}")
    return "\n".join(lines)
