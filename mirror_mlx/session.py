"""One conversation's state (the KV caches and the tokens they hold) and the generation loop
around the decoders: prefix reuse, prefill, stop conditions, streaming text, stats."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from .decode.autoregressive import autoregressive
from .decode.length import DraftLength
from .decode.mirror import MirrorConfig, mirror
from .decode.sampling import Sampler, SamplingParams
from .decode.schedule import scheduler_for
from .decode.speculative import speculative
from .decode.stats import GenerationStats
from .draft.base import DRAFT_WAIT_S, Drafter, DraftLost, Features, Job
from .errors import InvalidParameter, PromptTooLong
from .memory import CacheClearer
from .models import split
from .models.load import LoadedModel
from .text import TextStream

PREFILL_CHUNK = 512
MODES = ("ar", "sd", "mirror")


@dataclass
class DecodeSettings:
    mode: str = "ar"  # ar | sd | mirror
    gamma: int | None = None  # drafted tokens per step (sd and mirror); None: adaptive
    mirror: MirrorConfig = field(default_factory=MirrorConfig)

    def check(self, num_layers: int) -> None:
        m = self.mirror
        if self.mode not in MODES:
            raise InvalidParameter(f"mode must be one of {', '.join(MODES)} (got '{self.mode}')")
        if self.gamma is not None and self.gamma < 1:
            raise InvalidParameter(f"gamma must be at least 1 (got {self.gamma})")
        if m.kappa < 1:
            raise InvalidParameter(f"kappa must be at least 1 (got {m.kappa})")
        if m.budget is not None and m.budget < 0:
            raise InvalidParameter(f"branch budget must be >= 0 (got {m.budget})")
        layer = m.exit_head.layer if m.exit_head else m.exit_layer
        if self.mode == "mirror" and not 0 < layer < num_layers:
            raise InvalidParameter(f"exit layer must be in 1..{num_layers - 1} (got {layer})")


@dataclass
class Chunk:
    """A piece of a streamed generation. The last chunk carries `stats`."""

    text: str
    token_ids: list[int]
    stats: GenerationStats | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session:
    """Keeps the target's KV cache between generations, so a chat's earlier turns are not
    prefilled again: each prompt reuses the longest cached prefix."""

    def __init__(self, target: LoadedModel, context: int | None = None,
                 drafter: Drafter | None = None, settings: DecodeSettings | None = None):
        self.target = target
        self.drafter = drafter
        self.settings = settings or DecodeSettings()
        self.settings.check(target.num_layers)
        if self.settings.mode != "ar" and drafter is None:
            raise InvalidParameter(f"mode '{self.settings.mode}' needs a draft")
        self.timeline: list | None = None  # set to a list to record Mirror-SD step timings
        self.context = min(context or target.context_length, target.context_length)
        if self.context < 2:
            raise InvalidParameter(f"context must be at least 2 tokens (got {self.context})")
        self.cache = split.make_cache(target.model)
        self.tokens: list[int] = []  # what the cache holds, position by position
        # Mirror-SD's plan per step; what it measures holds across the session's generations.
        self.scheduler = scheduler_for(drafter, self.settings.mirror.budget,
                                       self.settings.mirror.separate_units) \
            if self.settings.mode == "mirror" else None
        # The adaptive draft length's measurements hold across generations too.
        self.length = DraftLength() if self.settings.gamma is None else None
        # Why the draft was given up for good (a job never returned, or its process ended).
        self.hung = ""

    def reset(self) -> None:
        self._trim(0)

    def check(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Raise the error `generate` would raise for these arguments, before any work."""
        if not prompt:
            raise InvalidParameter("the prompt is empty")
        if max_tokens < 1:
            raise InvalidParameter(f"max-tokens must be at least 1 (got {max_tokens})")
        if len(prompt) >= self.context:
            raise PromptTooLong(
                f"the prompt is {len(prompt)} tokens but the context holds {self.context} "
                "(and at least one new token must fit)"
            )

    def generate(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        cancel: threading.Event | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> Iterator[Chunk]:
        """Stream the continuation of `prompt` (token ids). Stops at EOS, a stop string,
        `max_tokens`, the end of the context, or when `cancel` is set."""
        prompt = list(prompt)
        self.check(prompt, max_tokens)
        mode = self.settings.mode if not self.hung else "ar"
        stats = GenerationStats(mode=self.settings.mode, prompt_tokens=len(prompt),
                                draft_fault=self.hung, **self.target.placement)
        sampler = Sampler(sampling or SamplingParams())
        clearer = CacheClearer(self.cache)
        mx.reset_peak_memory()
        start = time.perf_counter()
        draft_prefill = None
        reads = mode != "ar" and bool(self.drafter.feature_layers)
        if mode != "ar":
            self.drafter.reseed(sampler.params.seed)
            if not reads:  # the draft fills its own cache on its side while the target prefills
                draft_prefill = self.drafter.submit(Job([prompt], 0, label="prefill"))
        last, features = self._prefill(prompt, stats, cancel, on_prefill, clearer)
        if reads:  # a draft that reads the target's features prefills from them
            draft_prefill = self.drafter.submit(Job([prompt], 0, label="prefill",
                                                    features=features))
            features = []
        if draft_prefill is not None:
            try:
                self.drafter.run_pending()
                draft_prefill.result(DRAFT_WAIT_S)
            except Exception as e:
                mode = self._fault(e, stats)
        prefilled = time.perf_counter()
        stats.prefill_s = prefilled - start

        text = TextStream(self.target.tokenizer, stop)
        decoder = self._decoder(mode, prompt, last, sampler, stats, features)
        generated: list[int] = []
        finish = "cancelled" if cancel is not None and cancel.is_set() else ""
        try:
            while not finish:
                try:
                    step = next(decoder)
                except Exception as e:
                    if mode == "ar":
                        raise
                    # The draft failed mid-step: go on as target-only decoding from the last
                    # committed token (the target's cache is cut back to what precedes it).
                    mode = self._fault(e, stats)
                    decoder.close()
                    committed = prompt + generated
                    self._trim_cache(len(committed) - 1)
                    decoder = autoregressive(self.target.model, self.cache, committed[-1],
                                             sampler, stats)
                    continue
                if not generated:
                    stats.ttft_s = time.perf_counter() - start
                fresh: list[int] = []
                for token in step:
                    stats.committed_tokens += 1
                    if token in self.target.eos_token_ids:
                        finish = "stop"
                        break
                    generated.append(token)
                    fresh.append(token)
                    if text.stopped or len(generated) == max_tokens or \
                            len(prompt) + len(generated) >= self.context:
                        break
                piece = "".join(text.add(t) for t in fresh)
                if text.stopped:
                    finish = "stop"
                elif len(generated) == max_tokens:
                    finish = finish or "length"
                elif len(prompt) + len(generated) >= self.context:
                    finish = finish or "context"
                elif cancel is not None and cancel.is_set():
                    finish = "cancelled"
                clearer.add(len(step))
                if piece or fresh:
                    yield Chunk(piece, fresh)
        finally:
            decoder.close()
            self._settle(prompt + generated)
            clearer.finish()
        if self.scheduler is not None:
            stats.schedule = self.scheduler.explain()  # what it prefers now, after this reply
        end = time.perf_counter()
        stats.generated_tokens = len(generated)
        stats.finish_reason = finish
        stats.decode_s = end - prefilled
        stats.total_s = end - start
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        drafting = stats.time_s.get("draft", 0.0) + stats.time_s.get("draft_serial", 0.0)
        if drafting > 0:
            stats.overlap_fraction = stats.time_s.get("draft_hidden", 0.0) / drafting
        yield Chunk(text.flush(), [], stats)

    def _fault(self, error: Exception, stats: GenerationStats) -> str:
        """The draft failed: this generation goes on without it (and, if a job never returned,
        the session too). Returns the mode to decode in."""
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if isinstance(error, TimeoutError) and not str(error):
            why = f"a draft job did not return within {DRAFT_WAIT_S:.0f} s"
        if isinstance(error, (TimeoutError, DraftLost)):
            self.hung = why
        stats.draft_fault = why
        warnings.warn(f"the draft failed ({why}); decoding goes on with the target alone",
                      stacklevel=3)
        return "ar"

    def _decoder(self, mode: str, prompt: list[int], last: int, sampler: Sampler,
                 stats: GenerationStats, features: list[Features]):
        s, model, cache = self.settings, self.target.model, self.cache
        if mode == "ar":
            return autoregressive(model, cache, last, sampler, stats)
        committed = self.tokens + [last]
        gamma = self.length or s.gamma
        if s.mode == "sd":
            return speculative(model, cache, self.drafter, committed, sampler, stats, gamma,
                               self.context, features)
        mirror_config = MirrorConfig(**{**s.mirror.__dict__, "gamma": gamma})
        return mirror(model, cache, self.drafter, committed, sampler, stats, mirror_config,
                      self.context, self.scheduler, self.timeline, features)

    def _prefill(self, prompt, stats, cancel, on_prefill,
                 clearer: CacheClearer) -> tuple[int, list[Features]]:
        """Fill the cache with all of `prompt` but its last token, reusing what it holds.
        Returns the last token, and the target's features after the prefilled tokens when
        the draft reads them."""
        keep = common_prefix(self.tokens, prompt[:-1])
        self._trim(keep)
        stats.cached_prompt_tokens = keep
        todo = prompt[keep:-1]
        taps = self.drafter.feature_layers if self.drafter is not None and \
            self.settings.mode != "ar" else ()
        features = []
        for at in range(0, len(todo), PREFILL_CHUNK):
            if cancel is not None and cancel.is_set():
                break
            chunk = todo[at : at + PREFILL_CHUNK]
            _, feats = split.forward(self.target.model, mx.array(chunk)[None], self.cache, taps)
            states = [c.state for c in self.cache]
            mx.async_eval(states, feats)
            if self.drafter is not None:  # an inline drafter prefills now, beside the target
                self.drafter.run_pending()
            mx.eval(states)
            if taps:
                features.append(Features.of(prompt, keep + at, feats))
            self.tokens.extend(chunk)
            clearer.add(len(chunk))
            if on_prefill:
                on_prefill(keep + at + len(chunk), len(prompt) - 1)
        return prompt[-1], features

    def _trim(self, keep: int) -> None:
        self._trim_cache(keep)
        del self.tokens[keep:]

    def _trim_cache(self, keep: int) -> None:
        offset = self.cache[0].offset
        if offset > keep:
            for c in self.cache:
                c.trim(offset - keep)

    def _settle(self, committed: list[int]) -> None:
        """After a generation: the cache holds `committed` up to its own offset (a decoder may
        have run past what was emitted, e.g. past a stop string); drop anything beyond."""
        keep = min(self.cache[0].offset, len(committed) - 1)
        self.tokens = committed[:keep]
        self._trim(keep)
