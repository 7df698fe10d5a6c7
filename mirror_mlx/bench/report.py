"""A bench result -> summary statistics, JSON (raw data, machine, versions), a Markdown report."""

from __future__ import annotations

import datetime
import json
import platform as _platform
import statistics
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..models.load import LoadedModel
from ..platform import machine_info
from .harness import BenchResult, Run
from .identity import first_difference

# Per-generation metrics, summarized as median and min-max.
METRICS = ("ttft_s", "decode_tokens_per_second", "latency_s", "tokens_per_step", "reuse_rate",
           "fallback_rate", "speedup_vs_ar", "speedup_vs_sd", "speedup_vs_mlx_lm_sd")
BASELINES = {"speedup_vs_ar": "ar", "speedup_vs_sd": "sd", "speedup_vs_mlx_lm_sd": "mlx-lm-sd"}
LABELS = {"ar": "AR (ours)", "sd": "SD (ours)", "mirror": "Mirror-SD (ours)",
          "mlx-lm": "mlx-lm", "mlx-lm-sd": "mlx-lm SD"}


def spread(values: list[float | None]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def run_metrics(runs: list[Run]) -> list[dict]:
    """Each run's metrics; speedups compare decode tokens per second with the baseline mode's
    run of the same prompt, turn and repeat."""
    key = lambda r: (r.question_id, r.turn, r.repeat)  # noqa: E731
    tps = {(r.mode, *key(r)): r.decode_tokens_per_second for r in runs}
    out = []
    for r in runs:
        m = {"ttft_s": r.ttft_s, "decode_tokens_per_second": r.decode_tokens_per_second,
             "latency_s": r.latency_s,
             "tokens_per_step": r.stats.acceptance_length or None,
             "reuse_rate": r.stats.reuse_rate if r.mode == "mirror" else None,
             "fallback_rate": r.stats.fallback_rate if r.mode == "mirror" else None}
        for name, base in BASELINES.items():
            b = tps.get((base, *key(r)))
            mine = r.decode_tokens_per_second
            m[name] = mine / b if mine is not None and b else None
        out.append(m)
    return out


def _group(runs: list[Run], metrics: list[dict], by) -> dict:
    groups: dict = {}
    for r, m in zip(runs, metrics):
        groups.setdefault(by(r), []).append(m)
    return {k: {name: spread([m[name] for m in ms]) for name in METRICS} | {"runs": len(ms)}
            for k, ms in groups.items()}


def greedy_agreement(result: BenchResult) -> dict:
    """For greedy runs: how many generations of each mode equal AR's token for token, and for
    each other one its first difference and what that is (measure/identity.py): a tie (the
    target's own two best tokens there are equal up to rounding), a mismatch (a failure), or
    not compared (an earlier turn differed, so its prompt is not AR's)."""
    if result.config.temperature != 0 or "ar" not in result.config.modes:
        return {}
    ref = {(r.question_id, r.turn, r.repeat): r.token_ids for r in result.runs if r.mode == "ar"}
    out = {}
    for mode in result.config.modes:
        if mode == "ar":
            continue
        mine = [r for r in result.runs if r.mode == mode]
        differ = []
        for r in mine:
            want = ref[(r.question_id, r.turn, r.repeat)]
            if r.token_ids == want:
                continue
            verdict = r.identity.verdict if r.identity else "not compared"
            differ.append({"question_id": r.question_id, "turn": r.turn, "repeat": r.repeat,
                           "at": first_difference(r.token_ids, want), "verdict": verdict,
                           "detail": r.identity.describe() if r.identity else
                           "its prompt holds an earlier reply that differed",
                           "identity": r.identity.to_dict() if r.identity else None})
        out[mode] = {"identical": len(mine) - len(differ), "total": len(mine),
                     "ties": sum(d["verdict"] == "tie" for d in differ),
                     "mismatches": sum(d["verdict"] == "mismatch" for d in differ),
                     "not_compared": sum(d["verdict"] == "not compared" for d in differ),
                     "differ": differ}
    return out


def energy_summary(result: BenchResult) -> dict:
    e = result.energy
    out = {"backend": e.backend, "note": e.note, "modes": {}}
    if e.idle is None:
        return out
    idle_w = e.idle.watts
    out["idle"] = {"seconds": e.idle.seconds, "joules": e.idle.joules, "watts": idle_w}
    for mode, (reading, tokens) in e.modes.items():
        net = reading.total_j - idle_w * reading.seconds
        out["modes"][mode] = {
            "seconds": reading.seconds, "tokens": tokens, "joules": reading.joules,
            "watts": reading.watts,
            "joules_per_token": reading.total_j / tokens if tokens else None,
            "net_joules_per_token": net / tokens if tokens else None}
    return out


def summarize(result: BenchResult) -> dict:
    metrics = run_metrics(result.runs)
    per_prompt = _group(result.runs, metrics, lambda r: (r.question_id, r.mode))
    prompts: dict = {}
    for (qid, mode), s in per_prompt.items():
        category = next(r.category for r in result.runs if r.question_id == qid)
        prompts.setdefault(qid, {"category": category})[mode] = s
    per_category: dict = {}
    for (category, mode), s in _group(result.runs, metrics,
                                      lambda r: (r.category, r.mode)).items():
        per_category.setdefault(category, {})[mode] = s
    return {"overall": _group(result.runs, metrics, lambda r: r.mode),
            "per_category": per_category, "per_prompt": prompts,
            "greedy_agreement": greedy_agreement(result), "energy": energy_summary(result),
            "units": result.units, "schedule": schedule_summary(result),
            "draft_lengths": length_summary(result), "ranks": ranks_summary(result)}


def ranks_summary(result: BenchResult) -> dict:
    """Across ranks, per mode: the transfers' time per step (a probe's at start), per token
    and as a share of decoding: speculation commits several tokens per transfer."""
    out: dict = {}
    for r in result.runs:
        st = r.stats
        if st.ranks < 2:
            continue
        m = out.setdefault(r.mode, {"ranks": st.ranks, "parallel": st.parallel,
                                    "split": st.split, "comm_ms_per_step": 1e3 * st.comm_s,
                                    "steps": 0, "tokens": 0, "decode_s": 0.0})
        m["steps"] += st.target_steps
        m["tokens"] += st.committed_tokens
        m["decode_s"] += st.decode_s
    for m in out.values():
        comm = m["comm_ms_per_step"] * m["steps"]
        m["comm_ms_per_token"] = comm / max(m["tokens"], 1)
        m["comm_share"] = comm / 1e3 / m["decode_s"] if m["decode_s"] else 0.0
    return out


def length_summary(result: BenchResult) -> dict:
    """Per speculative mode, its steps by the number of drafted tokens they verified (where
    the length adapts)."""
    out: dict = {}
    for r in result.runs:
        for n, count in r.stats.draft_lengths.items():
            modes = out.setdefault(r.mode, {})
            modes[int(n)] = modes.get(int(n), 0) + count
    return {mode: dict(sorted(v.items())) for mode, v in out.items()}


def schedule_summary(result: BenchResult) -> dict:
    """Mirror-SD's steps per plan over the run, and what its scheduler said at the end."""
    mirror = [r for r in result.runs if r.mode == "mirror"]
    steps: dict[str, int] = {}
    for r in mirror:
        for plan, n in r.stats.plan_steps.items():
            steps[plan] = steps.get(plan, 0) + n
    return {"plan_steps": steps, "last": mirror[-1].stats.schedule if mirror else ""}


def _versions() -> dict:
    out = {"python": _platform.python_version()}
    for pkg in ("mirror-mlx", "mlx", "mlx-cpu", "mlx-metal", "mlx-lm", "numpy", "transformers",
                "matplotlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _machine() -> dict:
    import mlx.core as mx

    info = asdict(machine_info())
    try:
        info["device_name"] = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):
        pass
    return info


def to_json(result: BenchResult, summary: dict, target: LoadedModel, prompts_source: str,
            command: str) -> dict:
    return {
        "command": command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "versions": _versions(),
        "target": {"spec": target.name, "path": str(target.path), "dtype": target.dtype,
                   "layers": target.num_layers},
        "draft": result.draft,
        "prompts": {"source": prompts_source,
                    "questions": len({r.question_id for r in result.runs}),
                    "categories": sorted({r.category for r in result.runs})},
        "config": asdict(result.config),
        "summary": summary,
        "timeline": [{"label": a, "start_s": b, "end_s": c} for a, b, c in result.timeline],
        "runs": [{"mode": r.mode, "question_id": r.question_id, "category": r.category,
                  "turn": r.turn, "repeat": r.repeat, "ttft_s": r.ttft_s,
                  "latency_s": r.latency_s,
                  "decode_tokens_per_second": r.decode_tokens_per_second,
                  "first_step_tokens": r.first_step_tokens, "token_ids": r.token_ids,
                  "identity": r.identity.to_dict() if r.identity else None,
                  "stats": r.stats.to_dict()} for r in result.runs],
    }


def _cell(s: dict | None, digits: int = 2, with_range: bool = False, pct: bool = False) -> str:
    if s is None:
        return "—"
    fmt = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.{digits}f}")
    text = fmt(s["median"])
    return f"{text} ({fmt(s['min'])}–{fmt(s['max'])})" if with_range else text


_HEADER = ("| TTFT s | decode tok/s | latency s | tok/step | reuse | fallback | × AR "
           "| × SD | × mlx-lm SD |")


def _row(s: dict) -> str:
    return " | ".join([
        str(s["runs"]), _cell(s["ttft_s"], 3), _cell(s["decode_tokens_per_second"], 1),
        _cell(s["latency_s"], 2), _cell(s["tokens_per_step"], 2),
        _cell(s["reuse_rate"], pct=True), _cell(s["fallback_rate"], pct=True),
        _cell(s["speedup_vs_ar"], 2, True), _cell(s["speedup_vs_sd"], 2, True),
        _cell(s["speedup_vs_mlx_lm_sd"], 2, True)])


def markdown(doc: dict, plots: dict[str, str]) -> str:
    s, c = doc["summary"], doc["config"]
    m, t, d = doc["machine"], doc["target"], doc["draft"]
    lines = [
        "# mirror-mlx bench", "",
        f"Command: `{doc['command']}`", "",
        f"- Machine: {m['platform']} {m['machine']}, {m.get('device_name') or ''} "
        f"({m['cpu_count']} cores); MLX {m['mlx_version']} on {m['mlx_device']} "
        f"({m['mlx_backend']}), BLAS {m['blas']}",
        f"- Target: {t['spec']} ({t['dtype']}, {t['layers']} layers)",
        f"- Draft: {d['spec']} ({d['layers']} layers, hidden {d['hidden_size']}, head "
        f"{d['head_size']} tokens), gamma {d['gamma']}"
        + ("; sd and mirror also copy drafts from the context (prompt lookup)"
           if d.get("lookup") else "") if d else "- Draft: none",
        f"- Prompts: {doc['prompts']['source']} ({doc['prompts']['questions']} questions, "
        f"{len(doc['prompts']['categories'])} categories); {c['max_tokens']} new tokens, "
        f"temperature {c['temperature']}, {c['repeats']} repeat(s), modes interleaved",
        f"- Created {doc['created']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()),
        "",
        "All modes are timed by the same clock around their stream of target steps. TTFT: "
        "request start to the first step's tokens. Decode tok/s: tokens after the first step / "
        "time after it. Latency: start to end. Speedups: decode tok/s over the baseline's on "
        "the same prompt, turn and repeat, median (min–max). Other columns: medians.",
        "",
        "## All categories", "",
        "| Mode | runs " + _HEADER,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in s["overall"].items():
        lines.append(f"| {LABELS[mode]} | {_row(row)} |")
    lines += ["", "## Per category", "", "| Category | Mode | runs " + _HEADER,
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for category, modes in sorted(s["per_category"].items()):
        for mode in c["modes"]:
            if mode in modes:
                lines.append(f"| {category} | {LABELS[mode]} | {_row(modes[mode])} |")
    lines += ["", "## Per prompt (decode tok/s, median)", "",
              "| Question | Category | " + " | ".join(LABELS[m] for m in c["modes"]) + " |",
              "|---|---|" + "---:|" * len(c["modes"])]
    for qid, row in s["per_prompt"].items():
        cells = [_cell(row[m]["decode_tokens_per_second"], 1) if m in row else "—"
                 for m in c["modes"]]
        lines.append(f"| {qid} | {row['category']} | " + " | ".join(cells) + " |")
    if s["greedy_agreement"]:
        lines += ["", "## Greedy agreement with AR (ours)", "",
                  "Where a generation differs from AR's, the first difference is a tie if the "
                  "target's own two best tokens there are equal up to rounding, computed one "
                  "token at a time and in a window (the tolerance is a few ulps of the compute "
                  "dtype); anything else is a mismatch: a failure.", ""]
        for mode, a in s["greedy_agreement"].items():
            lines.append(f"- {LABELS[mode]}: {a['identical']}/{a['total']} generations "
                         f"token-identical, {a['ties']} ties, {a['mismatches']} mismatches"
                         + (f", {a['not_compared']} not compared" if a["not_compared"] else ""))
            lines += [f"  - q{d['question_id']}.{d['turn'] + 1}, repeat {d['repeat'] + 1}: "
                      f"{d['detail']}" for d in a["differ"]]
    u, sched = s.get("units") or {}, s.get("schedule") or {}
    if u or sched.get("plan_steps"):
        lines += ["", "## Compute units and Mirror-SD's schedule", ""]
    if u:
        where = (u.get("target_device", "cpu"), u.get("draft_device", "cpu"))
        layout = ("A core each for target and draft (one BLAS thread per call)"
                  if u["separate_units"] else
                  f"The target computes on the {where[0]}, the draft on the {where[1]}"
                  if where[0] != where[1] else
                  "Target and draft share the " + ("cores" if where[0] == "cpu" else "GPU"))
        if "slowdown" in u:
            layout += (f"; a target verification forward takes {u['target_alone_ms']:.1f} ms "
                       f"alone and {u['target_beside_ms']:.1f} ms with the draft computing "
                       f"beside it ({u['slowdown']:.2f}×); a draft forward "
                       f"{u['draft_alone_ms']:.1f} ms alone, {u['draft_beside_ms']:.1f} ms "
                       "beside the target")
        lines.append(f"- {layout}")
    if sched.get("plan_steps"):
        lines.append("- Mirror-SD steps per plan: " + ", ".join(
            f"{k} {v}" for k, v in sorted(sched["plan_steps"].items())))
        lines.append(f"- Its scheduler at the end: {sched['last']}")
    if s.get("draft_lengths"):
        lines += ["", "## Draft lengths (adaptive)", "",
                  "Target steps by the number of drafted tokens they verified:", ""]
        for mode, counts in s["draft_lengths"].items():
            total = sum(counts.values())
            mean = sum(n * c for n, c in counts.items()) / max(total, 1)
            lines.append(f"- {LABELS[mode]}: mean {mean:.2f}; " + ", ".join(
                f"{n}: {c}" for n, c in counts.items()))
    if s.get("ranks"):
        first = next(iter(s["ranks"].values()))
        lines += ["", "## Across ranks", "",
                  f"The target on {first['ranks']} ranks ({first['parallel']}"
                  + (f", layers {'/'.join(map(str, first['split']))}" if first["split"] else "")
                  + "). Transfers: a one-token forward's, timed at start (the ring's round "
                  "trip, or its all-reduces), times the decoding steps; the share is of "
                  "decoding time.",
                  "",
                  "| Mode | transfers ms/step | steps/token | transfers ms/token | share of "
                  "time |", "|---|---:|---:|---:|---:|"]
        for mode, r in s["ranks"].items():
            lines.append(f"| {LABELS[mode]} | {r['comm_ms_per_step']:.2f} | "
                         f"{r['steps'] / max(r['tokens'], 1):.2f} | "
                         f"{r['comm_ms_per_token']:.2f} | {r['comm_share']:.1%} |")
    e = s["energy"]
    lines += ["", "## Energy", "", f"Meter: {e['backend']} — {e['note']}.", ""]
    if "idle" in e:
        lines += [f"Idle baseline: {e['idle']['watts']:.2f} W over {e['idle']['seconds']:.1f} s.",
                  "", "| Mode | window s | tokens | avg W | J/token | J/token above idle | "
                  "rails (J) |", "|---|---:|---:|---:|---:|---:|---|"]
        for mode, r in e["modes"].items():
            rails = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["joules"].items()))
            jpt = "—" if r["joules_per_token"] is None else f"{r['joules_per_token']:.4f}"
            net = "—" if r["net_joules_per_token"] is None else f"{r['net_joules_per_token']:.4f}"
            lines.append(f"| {LABELS[mode]} | {r['seconds']:.1f} | {r['tokens']} | "
                         f"{r['watts']:.2f} | {jpt} | {net} | {rails} |")
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{title}]({name})" for title, name in plots.items()]
    return "\n".join(lines) + "\n"


def write_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1))
