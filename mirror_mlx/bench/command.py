"""`mirror-mlx bench`: prompts and target in, JSON + Markdown + PNG plots out."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from ..energy.select import open_meter
from ..errors import MirrorError, MissingExtra
from ..models.load import LoadedModel, load
from .harness import BenchConfig, run_bench
from .prompts import load_prompts
from .report import markdown, summarize, to_json, write_json


def bench_command(target_spec: str | LoadedModel | None, prompts_source: str,
                  config: BenchConfig, out: Path, energy: str = "auto",
                  per_category: int | None = None, dtype: str = "auto", command: str = "",
                  quiet: bool = False, prepare: Callable | None = None) -> dict:
    """Runs the bench and writes bench.json, bench.md and the plots into `out`. Checks
    everything it can before loading the model (`target_spec`, unless loaded: split over
    ranks); returns the JSON document. `prepare(engine)`: called on each engine made."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtra("the bench's plots need matplotlib: pip install 'mirror-mlx[bench]'")
    config.check()
    prompts = load_prompts(prompts_source, per_category)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MirrorError(f"{out}: cannot create the output folder ({e})") from e
    target = target_spec if isinstance(target_spec, LoadedModel) else \
        load(target_spec, dtype=dtype, quiet=quiet)
    meter = open_meter(energy)
    if not quiet:
        print(f"energy: {meter.backend} — {meter.note}", file=sys.stderr)
    try:
        result = run_bench(target, prompts, config, meter, quiet=quiet, prepare=prepare)
    finally:
        meter.close()
    from .plots import write_plots

    summary = summarize(result)
    doc = to_json(result, summary, target, prompts_source, command)
    plots = write_plots(summary, result.runs, result.timeline, list(config.modes), out)
    write_json(doc, out / "bench.json")
    (out / "bench.md").write_text(markdown(doc, plots))
    return doc
