"""The benchmark harness: every mode on the same prompts, in one process, on one loaded target.

Modes: `ar`, `sd`, `mirror` (ours) and `mlx-lm`, `mlx-lm-sd` (mlx-lm's own generation, target
only and speculative, on the same target and draft weights). After a warm-up generation per
mode, the modes take turns on each prompt, in an order that rotates from prompt to prompt and
repeat to repeat, so that machine drift (thermals, other load) spreads over all of them.

Every mode is timed from outside by the same clock around its stream of target steps:
time to first token = request start to the first step's tokens (prefill plus one step); decode
tokens per second = tokens after the first step / time after it; latency = start to end.
Every generation prefills its whole prompt (no KV cache carried between generations), so all
modes do the same work; a later turn of a conversation follows the mode's own earlier reply.

Energy is measured in a phase of its own, after the timing: IOReport-style counters need long
windows, so each mode generates back-to-back for `energy_seconds`, after an idle window of the
same length that gives the baseline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ..api import Engine
from ..decode.sampling import SamplingParams
from ..decode.schedule import device_name
from ..decode.stats import GenerationStats
from ..draft.known import AUTO, choose, named_on_hub
from ..draft.load import load_draft
from ..draft.net import DraftNet
from ..draft.select import mlx_device
from ..energy.meter import EnergyReading, measure
from ..energy.select import MeterChoice
from ..errors import InvalidParameter
from ..models.load import LoadedModel
from ..platform import set_blas_threads
from ..progress import Progress
from .contention import measure_contention
from .identity import Identity, compare
from .mlx_lm_modes import MLXLMDraft, mlx_lm_steps, tokenizer_wrapper
from .prompts import BenchPrompt

MODES = ("ar", "sd", "mirror", "mlx-lm", "mlx-lm-sd")
TIMELINE_MODE = "mirror"
MLX_LM_GAMMA = 5  # mlx-lm's draft length where ours adapts


@dataclass
class BenchConfig:
    modes: tuple[str, ...] = MODES
    max_tokens: int = 128
    temperature: float = 0.0
    repeats: int = 1
    gamma: int | None = None  # None: adaptive (sd, mirror); mlx-lm-sd then drafts MLX_LM_GAMMA
    seed: int = 0
    draft: str | None = None  # draft spec (draft/load.py); None: the default draft
    lookup: bool = True  # sd and mirror also draft by copying from the context (draft/lookup.py)
    branch_budget: int | None = None  # mirror's work beside the target; None: auto
    exit_head: str | None = None  # mirror's exit head spec (draft/load.py); None: the default
    draft_device: str = "auto"  # where sd's and mirror's draft runs (draft/select.py)
    # A core each for the target and the draft (one BLAS thread per call, the draft on its own
    # thread), for every mode: drafting beside the target on a unit of its own, on one host.
    separate_units: bool = False
    energy_seconds: float = 20.0
    warmup_tokens: int = 8

    def check(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes or len(set(self.modes)) != len(self.modes):
            raise InvalidParameter(f"--modes takes distinct modes from {', '.join(MODES)} "
                                   f"(got {','.join(self.modes) or 'none'})")
        for name, value, low in (("max-tokens", self.max_tokens, 1), ("repeats", self.repeats, 1),
                                 ("gamma", self.gamma or 1, 1)):
            if value < low:
                raise InvalidParameter(f"--{name} must be at least {low} (got {value})")
        if self.energy_seconds < 0:
            raise InvalidParameter(f"--energy-seconds must be >= 0 (got {self.energy_seconds})")
        SamplingParams(temperature=self.temperature)  # validates


@dataclass
class Run:
    """One generation of one mode: a turn of a prompt, in one repeat."""

    mode: str
    question_id: str
    category: str
    turn: int
    repeat: int
    token_ids: list[int]
    first_step_tokens: int
    ttft_s: float
    latency_s: float
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)
    # Greedy runs that differ from AR's: what the difference is (set by `check_identity`).
    identity: Identity | None = None

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first target step per second after it; None if there were none."""
        after = self.generated_tokens - self.first_step_tokens
        spent = self.latency_s - self.ttft_s
        return after / spent if after > 0 and spent > 0 else None


@dataclass
class EnergyResult:
    backend: str
    note: str
    idle: EnergyReading | None = None
    modes: dict[str, tuple[EnergyReading, int]] = field(default_factory=dict)  # tokens too


@dataclass
class BenchResult:
    config: BenchConfig
    runs: list[Run]
    energy: EnergyResult
    timeline: list[tuple[str, float, float]]  # first Mirror-SD generation, seconds from start
    draft: dict  # what the speculative modes drafted with
    units: dict = field(default_factory=dict)  # compute layout and its contention check


class _Mode:
    """A mode as the harness drives it: `steps` yields each target step's tokens and returns
    the generation's GenerationStats."""

    def __init__(self, name: str, target: LoadedModel, config: BenchConfig,
                 engine: Engine | None = None, mlx_draft: MLXLMDraft | None = None):
        self.name, self.target, self.config = name, target, config
        self.engine, self.mlx_draft = engine, mlx_draft
        self.wrapper = tokenizer_wrapper(target) if engine is None else None

    def steps(self, ids: list[int], max_tokens: int, seed: int,
              timeline: list | None = None) -> Iterator[list[int]]:
        temperature = self.config.temperature
        if self.engine is None:
            stats = GenerationStats(mode=self.name, **self.target.placement)
            yield from mlx_lm_steps(self.target, self.wrapper, ids, max_tokens, temperature,
                                    seed, self.mlx_draft, self.config.gamma or MLX_LM_GAMMA,
                                    stats)
            return stats
        session = self.engine.session
        session.reset()  # no KV cache carried over: every mode prefills the whole prompt
        session.timeline = timeline
        stats = None
        try:
            for chunk in self.engine.stream(ids, max_tokens=max_tokens, sampling=SamplingParams(
                    temperature=temperature, seed=seed)):
                stats = chunk.stats or stats
                if chunk.token_ids:
                    yield chunk.token_ids
        finally:
            session.timeline = None
        return stats

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _open_modes(target: LoadedModel, config: BenchConfig, prepare: Callable | None = None
                ) -> tuple[Engine, dict[str, _Mode]]:
    """The modes, and an engine whose `encode` gives every mode the same prompt ids.
    `prepare(engine)` is called on each engine (a pipeline brings back what it reads)."""
    ar = Engine(target, mode="ar")
    modes: dict[str, _Mode] = {}
    try:
        for name in config.modes:
            if name == "ar":
                modes[name] = _Mode(name, target, config, engine=ar)
            elif name in ("sd", "mirror"):
                modes[name] = _Mode(name, target, config, engine=Engine(
                    target, mode=name, draft=config.draft, gamma=config.gamma,
                    lookup=config.lookup, branch_budget=config.branch_budget,
                    exit_head=config.exit_head, draft_device=config.draft_device,
                    separate_units=config.separate_units))
                if prepare is not None:
                    prepare(modes[name].engine)
            elif name == "mlx-lm":
                modes[name] = _Mode(name, target, config)
            else:
                net = load_draft(config.draft, target)
                if net.reads_features:  # mlx-lm cannot feed it the target's features
                    net = load_draft("default-tokens", target)
                draft = MLXLMDraft(net)
                modes[name] = _Mode(name, target, config, mlx_draft=draft)
    except BaseException:
        for m in modes.values():
            m.close()
        ar.close()
        raise
    return ar, modes


def _describe_draft(net: DraftNet | None, config: BenchConfig, target: LoadedModel) -> dict:
    if net is None:
        return {}
    c = net.config
    spec = config.draft or AUTO
    if spec == AUTO:  # what it resolved to (said, not fetched, again)
        spec = f"{AUTO} ({choose(target.name, named_on_hub(target)).spec})"
    return {"spec": spec, "layers": c.num_layers,
            "hidden_size": c.hidden_size, "head_size": c.head_size,
            "gamma": config.gamma or "auto", "reads_features": c.feature_layers,
            "lookup": config.lookup}


def _timed(mode: _Mode, ids: list[int], max_tokens: int, seed: int,
           timeline: list | None = None) -> tuple[list[int], int, float, float, GenerationStats]:
    """(tokens, first step's token count, TTFT, latency, stats), on the harness's clock."""
    tokens: list[int] = []
    first = 0
    start = time.perf_counter()
    t_first = None
    gen = mode.steps(ids, max_tokens, seed, timeline)
    while True:
        try:
            step = next(gen)
        except StopIteration as done:
            stats = done.value
            break
        if t_first is None:
            t_first, first = time.perf_counter(), len(step)
        tokens += step
    end = time.perf_counter()
    ttft = (t_first or end) - start
    # mlx-lm's stream does not time itself: its stats take the harness's times.
    stats.ttft_s, stats.total_s = stats.ttft_s or ttft, stats.total_s or end - start
    return tokens, first, ttft, end - start, stats


def conversation(prompt: BenchPrompt, replies: list[str], turn: int) -> str | list[dict]:
    if turn == 0:
        return prompt.turns[0]  # text: a model without a chat template takes it as it is
    messages = []
    for i in range(turn):
        messages += [{"role": "user", "content": prompt.turns[i]},
                     {"role": "assistant", "content": replies[i]}]
    return messages + [{"role": "user", "content": prompt.turns[turn]}]


def ar_turns(runs: list[dict], prompts: list[BenchPrompt], engine: Engine
             ) -> Iterator[tuple[str, list[int], list[int]]]:
    """A bench run's AR replies (its `runs`), each with its prompt's category and the token
    ids it answered: the conversation up to its turn with the replies before it, encoded as the
    run encoded it. For measures that teacher-force a draft over what AR wrote."""
    replies = {(r["question_id"], r["turn"]): r["token_ids"] for r in runs if r["mode"] == "ar"}
    for p in prompts:
        texts: list[str] = []
        for turn in range(len(p.turns)):
            reply = replies.get((str(p.question_id), turn))
            if reply is None:
                break
            yield p.category, engine.encode(conversation(p, texts, turn)), reply
            texts.append(engine.target.tokenizer.decode(reply, skip_special_tokens=True))


def run_bench(target: LoadedModel, prompts: list[BenchPrompt], config: BenchConfig,
              energy: MeterChoice, quiet: bool = False, prepare: Callable | None = None
              ) -> BenchResult:
    config.check()
    if not prompts:
        raise InvalidParameter("no prompts to run")
    threads = config.separate_units and set_blas_threads(1)
    encoder, modes = _open_modes(target, config, prepare)
    try:
        net = load_draft(config.draft, target) if any(
            m in config.modes for m in ("sd", "mirror", "mlx-lm-sd")) else None
        draft = _describe_draft(net, config, target)
        units = _check_units(target, net, config)
        warm = prompts[0]
        for mode in modes.values():
            _timed(mode, encoder.encode(warm.turns[0]),
                   min(config.warmup_tokens, config.max_tokens), config.seed)
        runs, timeline = _timing_phase(target, prompts, config, encoder, modes, quiet)
        check_identity(target, runs, config)
        energy_result = _energy_phase(prompts, config, encoder, modes, energy, quiet)
    finally:
        for mode in modes.values():
            mode.close()
        encoder.close()
        if threads:
            set_blas_threads(os.cpu_count() or 1)
    return BenchResult(config, runs, energy_result, timeline, draft, units)


def _check_units(target: LoadedModel, net: DraftNet | None, config: BenchConfig) -> dict:
    """Where target and draft compute, and how much the draft beside slows the target."""
    on = mlx_device(config.draft_device)
    units = {"separate_units": config.separate_units,
             "blas_threads": 1 if config.separate_units else os.cpu_count(),
             "target_device": device_name(mx.default_device()),
             "draft_device": device_name(on or mx.default_device())}
    if net is not None:
        units |= measure_contention(target, net, (config.gamma or MLX_LM_GAMMA) + 1,
                                    draft_device=on)
    return units


def _timing_phase(target, prompts, config, encoder, modes, quiet):
    names = list(modes)
    total = config.repeats * len(names) * sum(len(p.turns) for p in prompts)
    progress = Progress("bench", total, "gen", quiet=quiet)
    runs: list[Run] = []
    timeline: list = []
    recorded = False
    for r in range(config.repeats):
        for i, prompt in enumerate(prompts):
            k = (i + r) % len(names)
            for name in names[k:] + names[:k]:
                replies: list[str] = []
                for turn in range(len(prompt.turns)):
                    ids = encoder.encode(conversation(prompt, replies, turn))
                    spans = [] if name == TIMELINE_MODE and not recorded else None
                    seed = config.seed + 1000 * r + turn
                    tokens, first, ttft, latency, stats = _timed(
                        modes[name], ids, config.max_tokens, seed, spans)
                    if spans:
                        t0 = min(a for _, a, _ in spans)
                        timeline = [(label, a - t0, b - t0) for label, a, b in spans]
                        recorded = True
                    runs.append(Run(name, prompt.question_id, prompt.category, turn, r, tokens,
                                    first, ttft, latency, stats, ids))
                    replies.append(target.tokenizer.decode(tokens, skip_special_tokens=True))
                    progress.advance(1, f"{name} q{prompt.question_id}.{turn + 1}")
    progress.close()
    return runs, timeline


def check_identity(target: LoadedModel, runs: list[Run], config: BenchConfig) -> None:
    """Greedy: each run that differs from AR's run of the same prompt gets its `identity`
    (tie or mismatch, measure/identity.py). A later turn whose conversation holds an earlier
    differing reply has another prompt than AR's: nothing to compare it with."""
    if config.temperature != 0 or "ar" not in config.modes:
        return
    ar = {(r.question_id, r.turn, r.repeat): r for r in runs if r.mode == "ar"}
    for r in runs:
        ref = ar[(r.question_id, r.turn, r.repeat)]
        if r.mode != "ar" and r.token_ids != ref.token_ids and r.prompt_ids == ref.prompt_ids:
            r.identity = compare(target, r.prompt_ids, ref.token_ids, r.token_ids)


def _energy_phase(prompts, config, encoder, modes, energy: MeterChoice, quiet):
    result = EnergyResult(energy.backend, energy.note)
    if not energy.available or config.energy_seconds == 0:
        if energy.available:
            result.note += "; not measured (--energy-seconds 0)"
        return result
    meter, window = energy.meter, config.energy_seconds
    progress = Progress("energy", len(modes) + 1, "window", quiet=quiet)
    result.idle, _ = measure(meter, lambda: time.sleep(window))
    progress.advance(1, "idle")
    firsts = [encoder.encode(p.turns[0]) for p in prompts]
    for name, mode in modes.items():

        def work(mode=mode):
            tokens, start, i = 0, time.perf_counter(), 0
            while time.perf_counter() - start < window:
                out = _timed(mode, firsts[i % len(firsts)], config.max_tokens, config.seed + i)
                tokens += len(out[0])
                i += 1
            return tokens

        result.modes[name] = measure(meter, work)
        progress.advance(1, name)
    progress.close()
    return result
