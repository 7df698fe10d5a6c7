"""The bench's PNG plots: speedup by category, tokens per second per mode, and the timeline of a
few Mirror-SD steps. Uses matplotlib's object API (no pyplot): no display, no global state."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .harness import Run
from .report import LABELS

_COLORS = {"ar": "#7f7f7f", "sd": "#1f77b4", "mirror": "#d62728", "mlx-lm": "#2ca02c",
           "mlx-lm-sd": "#9467bd"}
_SPANS = {"target": ("target", "#6baed6", "target (whole forward, no split)"),
          "target_prefix": ("target", "#1f77b4", "target prefix (layers 1..l_e)"),
          "target_suffix": ("target", "#aec7e8", "target suffix + verify"),
          "draft_early": ("draft", "#d62728", "draft: early rollout"),
          "draft_branches": ("draft", "#ff9896", "draft: branch rollouts"),
          "draft_fresh": ("draft", "#ff7f0e", "draft: fresh (fallback)")}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def speedup_by_category(summary: dict, modes: list[str], path: Path) -> Path | None:
    """Median decode speedup over AR (ours) per category, min-max as error bars."""
    shown = [m for m in modes if m != "ar"]
    if "ar" not in modes or not shown:
        return None
    categories = sorted(summary["per_category"])
    fig = _figure(max(6.0, 1.0 + 0.9 * len(categories)), 4.2)
    ax = fig.add_subplot()
    width = 0.8 / len(shown)
    x = np.arange(len(categories))
    for j, mode in enumerate(shown):
        cells = [summary["per_category"][c].get(mode, {}).get("speedup_vs_ar")
                 for c in categories]
        med = np.array([c["median"] if c else np.nan for c in cells])
        low = np.array([c["median"] - c["min"] if c else 0 for c in cells])
        high = np.array([c["max"] - c["median"] if c else 0 for c in cells])
        ax.bar(x + (j - (len(shown) - 1) / 2) * width, med, width, yerr=[low, high],
               capsize=2, color=_COLORS[mode], label=LABELS[mode])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, categories, rotation=30, ha="right")
    ax.set_ylabel("decode speedup over AR (ours)")
    ax.set_title("Speedup by category (median, min–max)")
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def tokens_per_second(runs: list[Run], modes: list[str], path: Path) -> Path | None:
    """Distribution of decode tokens per second per mode: box plot with every run as a dot."""
    data = [[r.decode_tokens_per_second for r in runs
             if r.mode == m and r.decode_tokens_per_second is not None] for m in modes]
    if not any(data):
        return None
    fig = _figure(1.6 + 1.3 * len(modes), 4.2)
    ax = fig.add_subplot()
    ax.boxplot([d or [np.nan] for d in data], showfliers=False)
    rng = np.random.default_rng(0)
    for i, (mode, d) in enumerate(zip(modes, data), 1):
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(d)), d, s=10, alpha=0.6,
                   color=_COLORS[mode], zorder=3)
    ax.set_xticks(range(1, len(modes) + 1), [LABELS[m] for m in modes])
    ax.set_ylabel("decode tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode speed per mode (one dot per generation)")
    fig.savefig(path)
    return path


def mirror_timeline(timeline: list[tuple[str, float, float]], path: Path,
                    steps: int = 6) -> Path | None:
    """The first `steps` Mirror-SD steps: the target (prefix and suffix where the step was
    split) on one lane, the draft's jobs on another, and each step's outcome (early rollout,
    branch, fallback)."""
    ends = [e for label, _, e in timeline if label in ("target", "target_suffix")]
    if not ends:
        return None
    until = ends[min(steps, len(ends)) - 1]
    spans = [(label, a, b) for label, a, b in timeline if a <= until]
    fig = _figure(10, 3.2)
    ax = fig.add_subplot()
    lanes = {"target": 1.0, "draft": 0.0}
    seen = set()
    for label, a, b in spans:
        if label.startswith("outcome:"):
            ax.annotate(label.split(":", 1)[1], (1e3 * a, 1.45), fontsize=7, ha="center",
                        rotation=30)
            ax.axvline(1e3 * a, color="black", linewidth=0.5, alpha=0.4)
            continue
        if label not in _SPANS:
            continue
        lane, color, text = _SPANS[label]
        ax.barh(lanes[lane], 1e3 * (b - a), left=1e3 * a, height=0.6, color=color,
                edgecolor="black", linewidth=0.3, label=None if label in seen else text)
        seen.add(label)
    ax.set_yticks(list(lanes.values()), ["target", "draft"])
    ax.set_ylim(-0.6, 1.9)
    ax.set_xlabel("ms since the first step began")
    ax.set_title(f"Mirror-SD: the first {min(steps, len(ends))} steps (draft work overlapping "
                 "the target's)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path)
    return path


def write_plots(summary: dict, runs: list[Run], timeline: list, modes: list[str],
                out: Path) -> dict[str, str]:
    """Writes the plots that have data; returns {title: file name}."""
    made = {
        "Speedup by category": speedup_by_category(summary, modes, out / "speedup_by_category.png"),
        "Decode tokens per second": tokens_per_second(runs, modes, out / "tokens_per_second.png"),
        "Mirror-SD timeline": mirror_timeline(timeline, out / "mirror_timeline.png"),
    }
    return {title: p.name for title, p in made.items() if p is not None}
