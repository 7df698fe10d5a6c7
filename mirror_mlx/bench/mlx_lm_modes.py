"""The baselines: mlx-lm's own generation (`stream_generate`), target-only and speculative, on
the same loaded target and the same draft weights as our modes.

mlx-lm wants a draft that looks like one of its models: called with (tokens, cache), returning
logits over the whole vocabulary, with `layers` and `make_cache`. `MLXLMDraft` presents a
DraftNet that way; a draft whose head scores only part of the vocabulary gets -inf elsewhere, so
its greedy pick is the one our drafter makes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    TokenizerWrapper,
)

from ..decode.stats import GenerationStats
from ..draft.net import DraftNet
from ..models.load import LoadedModel
from ..session import PREFILL_CHUNK


class MLXLMDraft:
    """A DraftNet as mlx-lm calls a draft model."""

    def __init__(self, net: DraftNet):
        self.net = net
        self.layers = net.layers
        restricted = len(net.config.head_tokens) > 0
        self._head_ids = net.head_ids if restricted else None

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        offset = cache[0].offset if cache else 0
        mask = "causal" if inputs.shape[1] > 1 else None
        logits = self.net(inputs, offset, mask, cache)
        if self._head_ids is None:
            return logits
        full = mx.full((*logits.shape[:-1], self.net.config.vocab_size), -mx.inf, logits.dtype)
        full[..., self._head_ids] = logits
        return full


def tokenizer_wrapper(target: LoadedModel) -> TokenizerWrapper:
    """mlx-lm's tokenizer wrapper with the detokenizer mlx-lm itself would pick."""
    tok = target.tokenizer
    detok = NaiveStreamingDetokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        if decoder.get("type") == "ByteLevel":
            detok = BPEStreamingDetokenizer
    return TokenizerWrapper(tok, detok, eos_token_ids=sorted(target.eos_token_ids))


def mlx_lm_steps(target: LoadedModel, wrapper: TokenizerWrapper, prompt: list[int],
                 max_tokens: int, temperature: float, seed: int | None,
                 draft: MLXLMDraft | None, gamma: int,
                 stats: GenerationStats) -> Iterator[list[int]]:
    """Yields the tokens of each target step of mlx-lm's generation, as our decoders do, and
    fills `stats` with what mlx-lm's stream tells (tokens, steps, drafts accepted)."""
    if seed is not None:
        mx.random.seed(seed)
    kwargs = dict(sampler=make_sampler(temp=temperature), prefill_step_size=PREFILL_CHUNK)
    if draft is not None:
        kwargs.update(draft_model=draft, num_draft_tokens=gamma)
    stats.prompt_tokens = len(prompt)
    mx.reset_peak_memory()  # per generation, as our session does
    step: list[int] = []
    for r in stream_generate(target.model, wrapper, mx.array(prompt), max_tokens, **kwargs):
        stats.peak_memory_gb = r.peak_memory
        stats.finish_reason = r.finish_reason or stats.finish_reason
        step.append(r.token)
        stats.committed_tokens += 1
        stats.accepted_tokens += r.from_draft
        if r.from_draft and r.finish_reason is None:
            continue
        # A target step ends with the target's own token, or where the generation ends.
        if draft is not None:
            stats.draft_tokens += min(gamma, max_tokens - stats.generated_tokens)
        stats.target_steps += 1
        if r.finish_reason == "stop":
            step.pop()  # the end-of-sequence token is committed, not generated
        stats.generated_tokens += len(step)
        if step:
            yield step
        step = []
