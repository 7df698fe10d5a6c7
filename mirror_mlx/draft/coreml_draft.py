"""The Core ML drafter: the draft as a Core ML package on the Neural Engine (macOS 15+).

It runs jobs inline, on the caller's thread, in `run_pending`: coremltools' predict holds the
GIL for the whole call (APPLE_APIS fact 1), so a worker thread would gain nothing; the decoders
dispatch the target's work with `mx.async_eval` first and then call `run_pending`, which is
where the two overlap. The package itself runs in a child process (coreml_process.py), so a
predict that hangs or crashes ends the draft, not the app.

The executor speaks the package contract of draft/coreml_package.py to a runtime with
`make_state()` and `predict(inputs, state)`: on macOS coremltools' CompiledMLModel, elsewhere
the reference executor (coreml_export/reference.py, the same PyTorch module the package was
converted from), so all the bookkeeping here is tested on Linux too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import IncompatibleDraft, ModelLoadError, PromptTooLong
from ..models.load import LoadedModel
from ..platform import cache_dir
from .base import Job, JobResult
from .coreml_package import (
    FEATURE_INPUTS,
    INPUT_HOLD_S,
    MASK_VALUE,
    STATES,
    WINDOW_INPUT,
    PackageSpec,
    rope_tables,
    unit_rms,
    window_visible,
)
from .coreml_process import ProcessRuntime
from .load import vocab_fingerprint
from .rollout import FED, OWN, TARGET, FeatureRefs, JobSeeds, TreeState, run_job


class CoreMLUnavailable(ModelLoadError):
    """Core ML could not compile or load a package that is itself readable."""


class Runtime(Protocol):
    def make_state(self) -> Any: ...

    def predict(self, inputs: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class CoreMLExecutor:
    """The rollout Executor over a package: pads each forward to an enumerated query length
    (or splits it), builds the fixed-width mask, and keeps the KV slots in the Core ML state."""

    def __init__(self, runtime: Runtime, spec: PackageSpec,
                 embed: Callable[[list[int]], np.ndarray]):
        c = spec.config
        self.runtime, self.spec, self.embed = runtime, spec, embed
        self.vocab_size = c.vocab_size
        self.head_ids = np.array(c.head_tokens or range(c.vocab_size), dtype=np.int32)
        self.streams = 0
        self.reads_features = spec.reads_features
        self.state = runtime.make_state()
        self.size = 0  # slots in use; those beyond hold stale or padding entries, never read
        # Per slot, a feature-conditioned draft's last-layer output (the next token's feature
        # where the target's is not known) and the feature the slot was fed (as MLXExecutor).
        width = c.hidden_size if self.reads_features else 0
        self.own = np.zeros((spec.context, width), np.float32)
        self.fed = np.zeros((spec.context, width), np.float32)
        # Per query length: [when predict last returned with them, inputs], oldest first.
        self._inputs = {s: deque() for s in spec.query_sizes}

    def _take_inputs(self, s: int) -> list:
        """[when predict last returned with them, a set of input buffers for query length s]
        that no predict has held in the last INPUT_HOLD_S seconds: Core ML may still read (and
        crash on the freed or refilled memory of) an input for about a second after predict
        returns, so each set is reused only after that, from a ring that grows to what ~2 s of
        calls need (two sets alternated would be refilled within milliseconds). The caller
        stamps the entry when its predict returns: stamped when taken, a fill that a busy CPU
        holds up would shorten the hold."""
        ring, now = self._inputs[s], time.perf_counter()
        if ring and now - ring[0][0] >= INPUT_HOLD_S:
            entry = ring.popleft()
            entry[0] = now
        else:
            entry = [now, {name: np.zeros(self.spec.input_shape(name, s),
                                          self.spec.input_dtype(name))
                           for name in self.spec.inputs}]
        ring.append(entry)
        return entry

    def truncate(self, size: int) -> None:
        self.size = min(self.size, size)

    def gather(self, dst: int, slots: list[int]) -> None:
        n = len(slots)
        if slots != list(range(dst, dst + n)):
            # KV slots move on the host through MLState.read_state / write_state (coremltools
            # 9.0): a whole-state copy each way, paid only when a reused branch is not already
            # in place, and it keeps the hot predict free of gathers.
            src = np.array(slots)
            for name in STATES:
                cache = self.state.read_state(name)
                cache[:, dst : dst + n] = cache[:, src]
                self.state.write_state(name, cache)
            self.own[dst : dst + n] = self.own[src]
            self.fed[dst : dst + n] = self.fed[src]
        self.size = dst + n

    def forward(self, tokens, positions, mask, rows, features=None) -> np.ndarray:
        n, start, L = len(tokens), self.size, self.spec.context
        if start + n > L:
            raise PromptTooLong(
                f"the Core ML draft holds {L} tokens and this generation needs more; export it "
                "with a larger --context or generate with a smaller one")
        if isinstance(positions, int):
            positions = range(positions, positions + n)
        c = self.spec.config
        embeds = self.embed(list(tokens))
        form = self.spec.form
        cos, sin = rope_tables(np.asarray(positions), form)
        if mask is None:  # causal over the whole cache
            mask = np.arange(start + n)[None, :] <= start + np.arange(n)[:, None]
        windowed = window_visible(mask, form.window) if form.window else None
        if form.eagle3 and (start or positions[0] == 0):
            # An EAGLE-3 head hides key 0 (position 0's, which never had a feature) from every
            # later token (eagle3._without_first).
            mask = mask.copy()
            mask[np.asarray(positions) > 0, 0] = False
        out = np.zeros((len(rows), c.head_size), np.float32)
        if features is not None:
            kinds, refs = np.array(features.kinds), np.array(features.refs)
            # FED reads what slots were fed before this call overwrites them: read it first.
            refed = {i: self.fed[refs[i]].copy() for i in np.flatnonzero(kinds == FED)}
        done = 0
        while done < n:
            s = self._query_size(n - done, L - start - done)
            take = min(s, n - done)
            if features is not None:
                # A token that reads the own output of one fed in this call waits for it.
                waits = [i for i in range(done + 1, done + take)
                         if kinds[i] == OWN and refs[i] >= start + done]
                take = (waits[0] if waits else done + take) - done
                s = self._query_size(take, L - start - done)
            entry = self._take_inputs(s)
            inputs = entry[1]
            part = slice(done, done + take)
            inputs["embeds"][0, :, 0, :take] = embeds[part].T
            inputs["rope_cos"][0, :, 0, :take] = cos[part].T
            inputs["rope_sin"][0, :, 0, :take] = sin[part].T
            width = mask.shape[1]
            inputs["mask"].fill(MASK_VALUE)
            inputs["mask"][0, :width, 0, :take] = np.where(mask[part].T, 0.0, MASK_VALUE)
            if windowed is not None:
                inputs[WINDOW_INPUT].fill(MASK_VALUE)
                inputs[WINDOW_INPUT][0, :width, 0, :take] = np.where(windowed[part].T, 0.0,
                                                                     MASK_VALUE)
            # Padding tokens (take..s) attend nowhere and are written past the end: harmless.
            inputs["embeds"][..., take:] = 0.0
            inputs["write_pos"][0] = start + done
            if features is not None:
                self._feature_inputs(inputs, features, kinds, refs, refed, done, take)
            try:
                result = self.runtime.predict(inputs, self.state)
            finally:
                entry[0] = time.perf_counter()  # the hold runs from here
            mine = [(i, r - done) for i, r in enumerate(rows) if done <= r < done + take]
            if mine:
                logits = np.concatenate([result[name][0, :, 0, :]
                                         for name in self.spec.outputs
                                         if name.startswith("logits_")])
                out[[i for i, _ in mine]] = logits[:, [j for _, j in mine]].T
            if features is not None:
                written = slice(start + done, start + done + take)
                self.own[written] = result["top"][0, :, 0, :take].T
                self.fed[written] = result["fed"][0, :, 0, :take].T
            done += take
        self.size = start + n
        return out[:, None]  # no speculative streams in a package: one token per row

    def _feature_inputs(self, inputs, features: FeatureRefs, kinds, refs, refed, done: int,
                        take: int) -> None:
        """Each token's feature for tokens done..done + take (padding after them reads
        nothing): the target's rows, or the vector the host keeps for it."""
        target, own, choose = (inputs[n][0, :, 0] for n in FEATURE_INPUTS)
        parts = self.spec.feature_parts
        target.fill(0.0)
        own.fill(0.0)
        choose.fill(0.0)
        for j, i in enumerate(range(done, done + take)):
            if kinds[i] == TARGET:
                # In float32 here: the target's states may pass float16's range (unit_rms).
                row = np.asarray(features.target[refs[i]])
                target[:, j] = unit_rms(row[None], parts)[0] if parts else row
                choose[0, j] = 1.0
            elif kinds[i] == OWN:
                own[:, j] = self.own[refs[i]]
            elif kinds[i] == FED:
                own[:, j] = refed[i]

    def _query_size(self, want: int, room: int) -> int:
        """The smallest enumerated length that holds `want` tokens, or the largest that fits
        in the slots left (the rest goes in further calls)."""
        fits = [s for s in self.spec.query_sizes if s <= room]
        return min((s for s in fits if s >= want), default=max(fits))


class _InlineFuture(Future):
    """A future whose `result()` first runs the drafter's queued jobs, so a decoder that waits
    on a job without calling `run_pending` still gets it."""

    def __init__(self, run_pending: Callable[[], None]):
        super().__init__()
        self._run_pending = run_pending

    def result(self, timeout: float | None = None):
        self._run_pending()
        return super().result(timeout)


class CoreMLDrafter:
    """A Drafter whose jobs run, in order, on the caller's thread in `run_pending`."""

    def __init__(self, executor: CoreMLExecutor, top_k: int = 4):
        self.vocab_size = executor.vocab_size
        self.context = executor.spec.context  # the most tokens the draft's cache holds
        self.head_ids = executor.head_ids  # the tokens its head scores
        self.compute = "coreml"  # on the units the package names (the Neural Engine), not MLX's
        self.feature_layers = tuple(executor.spec.config.feature_layers)
        self.inline = True
        self.top_k = top_k
        self._executor = executor
        self._state = TreeState()
        self._seeds = JobSeeds()
        self._pending: deque[tuple[Future | None, Callable[[], Any]]] = deque()

    def submit(self, job: Job) -> Future[JobResult]:
        future = _InlineFuture(self.run_pending)
        self._pending.append((future, partial(self._run, job)))
        return future

    def reseed(self, seed: int | None) -> None:
        self._pending.append((None, partial(self._seeds.reseed, seed)))  # in order with the jobs

    def run_pending(self) -> None:
        while self._pending:
            future, work = self._pending.popleft()
            if future is None:
                work()
            elif future.set_running_or_notify_cancel():
                try:
                    result = work()
                except BaseException as e:
                    future.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                else:
                    future.set_result(result)

    def _run(self, job: Job) -> JobResult:
        return run_job(job, self._executor, self._state, self._seeds.next(), self.top_k)

    def close(self) -> None:
        while self._pending:
            future, _ = self._pending.popleft()
            if future is not None:
                future.cancel()
        self._executor.runtime.close()


def mlx_embedding(embedding: nn.Module) -> Callable[[list[int]], np.ndarray]:
    """Token ids -> float32 embeddings from the target's table. The lookup runs on a CPU
    stream of its own, so it does not queue behind the target's work that the decoder has
    just dispatched with mx.async_eval."""
    stream = mx.new_thread_local_stream(mx.cpu)

    def embed(tokens: list[int]) -> np.ndarray:
        with mx.stream(stream):
            rows = embedding(mx.array(tokens, dtype=mx.int32)).astype(mx.float32)
            return np.array(rows, copy=True)

    return embed


def import_coremltools():
    """coremltools, imported without the warnings it logs on import where Core ML cannot run
    (its macOS bindings are missing) or with torch newer than it was tested with (2.13
    converts fine: PLATFORM.md)."""
    logger = logging.getLogger("coremltools")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import coremltools
    except ImportError as e:
        raise ModelLoadError("Core ML packages need coremltools "
                             "(pip install 'mirror-mlx[export]')") from e
    finally:
        logger.setLevel(level)
    return coremltools


def load_package(package: str | Path):
    """A package's spec (protobuf), readable on any OS."""
    package = Path(package)
    if not (package / "Manifest.json").is_file():
        raise ModelLoadError(f"{package}: not a Core ML package (.mlpackage folder)")
    ct = import_coremltools()
    try:
        spec = ct.utils.load_spec(str(package))
    except Exception as e:  # coremltools raises bare Exceptions for broken packages
        raise ModelLoadError(f"{package}: unreadable Core ML package ({e})") from e
    # An empty or cut model file parses as an empty spec: no version, no model in it.
    if not spec.specificationVersion or spec.WhichOneof("Type") is None:
        raise ModelLoadError(f"{package}: unreadable Core ML package (its model file holds "
                             "no model)")
    return spec


def read_package_spec(package: str | Path) -> PackageSpec:
    """The contract and provenance stored in a package's metadata (readable on any OS)."""
    spec = load_package(package)
    return PackageSpec.from_metadata(dict(spec.description.metadata.userDefined), str(package))


def check_target(spec: PackageSpec, target: LoadedModel, where: str) -> None:
    made_for = spec.config.target.get("vocab")
    if spec.config.vocab_size != target.vocab_size or (
            made_for and made_for != vocab_fingerprint(target.tokenizer)):
        raise IncompatibleDraft(
            f"{where}: this draft package was exported for another vocabulary "
            f"({spec.config.target.get('name', '?')}), not {target.path.name}'s")


def compiled_package(package: Path) -> Path:
    """The package compiled to .mlmodelc at a fixed path in the cache, keyed by its content:
    Core ML caches its device specialisation by that path, so a fixed path is specialised
    for the Neural Engine once, not on every load (APPLE_APIS fact 3)."""
    ct = import_coremltools()

    digest = hashlib.sha256()
    for f in sorted(p for p in package.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(package)).encode())
        digest.update(f.read_bytes())
    dest = cache_dir() / "coreml" / f"{digest.hexdigest()[:24]}.mlmodelc"
    if not dest.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.stem}.{os.getpid()}.tmp.mlmodelc")
        ct.utils.compile_model(str(package), str(tmp))
        try:
            tmp.rename(dest)
        except OSError:  # another process compiled it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def open_package(package: str | Path, target: LoadedModel, top_k: int = 4) -> CoreMLDrafter:
    """A drafter running `package` with Core ML (macOS 15+; see platform.coreml_status)."""
    package = Path(package)
    spec = read_package_spec(package)
    check_target(spec, target, str(package))
    try:
        runtime = ProcessRuntime(partial(compiled_model, compiled_package(package),
                                         spec.compute_units))
    except Exception as e:  # coremltools raises bare Exceptions (no bindings, compile errors)
        raise CoreMLUnavailable(f"Core ML could not load it ({e})") from e
    embed = mlx_embedding(target.model.model.embed_tokens)
    return CoreMLDrafter(CoreMLExecutor(runtime, spec, embed), top_k)


def compiled_model(compiled: Path, compute_units: str):
    """coremltools' model over a compiled package (run in the Core ML process)."""
    ct = import_coremltools()
    return ct.models.CompiledMLModel(str(compiled), compute_units=ct.ComputeUnit[compute_units])
