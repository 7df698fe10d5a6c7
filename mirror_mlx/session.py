"""One conversation's state (the KV caches and the tokens they hold) and the generation loop
around the decoders: prefix reuse, prefill, stop conditions, streaming text, stats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .decode.autoregressive import autoregressive
from .decode.sampling import Sampler, SamplingParams
from .errors import InvalidParameter, PromptTooLong
from .measure.stats import GenerationStats
from .models.load import LoadedModel
from .text import TextStream

PREFILL_CHUNK = 512


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

    def __init__(self, target: LoadedModel, context: int | None = None):
        self.target = target
        self.context = min(context or target.context_length, target.context_length)
        if self.context < 2:
            raise InvalidParameter(f"context must be at least 2 tokens (got {self.context})")
        self.cache = make_prompt_cache(target.model)
        self.tokens: list[int] = []  # what the cache holds, position by position

    def reset(self) -> None:
        self._trim(0)

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
        if not prompt:
            raise InvalidParameter("the prompt is empty")
        if max_tokens < 1:
            raise InvalidParameter(f"max-tokens must be at least 1 (got {max_tokens})")
        if len(prompt) >= self.context:
            raise PromptTooLong(
                f"the prompt is {len(prompt)} tokens but the context holds {self.context} "
                "(and at least one new token must fit)"
            )
        stats = GenerationStats(mode="ar", prompt_tokens=len(prompt))
        mx.reset_peak_memory()
        start = time.perf_counter()
        last = self._prefill(prompt, stats, cancel, on_prefill)
        prefilled = time.perf_counter()
        stats.prefill_s = prefilled - start

        text = TextStream(self.target.tokenizer, stop)
        sampler = Sampler(sampling or SamplingParams())
        decoder = autoregressive(self.target.model, self.cache, last, sampler, stats)
        generated: list[int] = []
        finish = "cancelled" if cancel is not None and cancel.is_set() else ""
        try:
            while not finish:
                step = next(decoder)
                if not generated:
                    stats.ttft_s = time.perf_counter() - start
                fresh: list[int] = []
                for token in step:
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
                if piece or fresh:
                    yield Chunk(piece, fresh)
        finally:
            decoder.close()
            self._settle(prompt + generated)
        end = time.perf_counter()
        stats.generated_tokens = len(generated)
        stats.finish_reason = finish
        stats.decode_s = end - prefilled
        stats.total_s = end - start
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        yield Chunk(text.flush(), [], stats)

    def _prefill(self, prompt, stats, cancel, on_prefill) -> int:
        """Fill the cache with all of `prompt` but its last token, reusing what it holds."""
        keep = common_prefix(self.tokens, prompt[:-1])
        self._trim(keep)
        stats.cached_prompt_tokens = keep
        todo = prompt[keep:-1]
        for at in range(0, len(todo), PREFILL_CHUNK):
            if cancel is not None and cancel.is_set():
                break
            chunk = todo[at : at + PREFILL_CHUNK]
            self.target.model(mx.array(chunk)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.tokens.extend(chunk)
            if on_prefill:
                on_prefill(keep + at + len(chunk), len(prompt) - 1)
        return prompt[-1]

    def _trim(self, keep: int) -> None:
        offset = self.cache[0].offset
        if offset > keep:
            for c in self.cache:
                c.trim(offset - keep)
        del self.tokens[keep:]

    def _settle(self, committed: list[int]) -> None:
        """After a generation: the cache holds `committed` up to its own offset (a decoder may
        have run past what was emitted, e.g. past a stop string); drop anything beyond."""
        keep = min(self.cache[0].offset, len(committed) - 1)
        self.tokens = committed[:keep]
        self._trim(keep)
