"""Greedy identity with target-only decoding, and what a difference means.

Speculative greedy decoding commits only the target's own argmax, so in exact arithmetic it
gives target-only decoding's tokens. The two compute those argmaxes differently, though: one
token per forward in target-only decoding, a window of several in verification. On the CPU in
float32 that never changes a token (exact identity, which the tests require). On a Mac's GPU
the two take different kernels (MLX's vector attention kernel up to 8 queries and the full one
above; `qmv` vs `qmm` for quantized matmuls), and in float16/bfloat16 a position where the
target's two best tokens are within rounding of each other can go either way.

`compare` tells those apart: at the first position where a run differs from the reference
(target-only) run, it computes the target's logits both ways and calls the difference a tie
only where both differing tokens are the target's best up to rounding in both forwards.
Anything else is a mismatch: a real failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import numpy as np

from ..decode.length import LONGEST
from ..errors import InvalidParameter
from ..models import split
from ..models.load import LoadedModel
from ..session import PREFILL_CHUNK

# Rounding tolerance, in units in the last place (ulps) of the compute dtype at the magnitude
# of the position's largest logit. A true tie reads up to one ulp either way once the logits
# are rounded to the dtype; beyond that the window and one-token forwards reduce in different
# orders in every layer, and those roundings reach the logits amplified. Measured on the
# default target in float32 on the CPU (sgemv vs sgemm), the top-2 gap moved by up to 9 ulps
# between the two forwards (40 positions): float32 gets 16. In float16/bfloat16 MLX's kernels
# accumulate in float32 and round each op's output, so the two paths mostly differ by whole
# roundings of intermediate outputs, a few ulps of the result: 4 (a judgement: on the CPU the
# two forwards agree bit for bit in half precision, so only a Mac can measure it). At a logit
# of 16 to 32 that is 3.8e-5 in float32, 0.0625 in float16 and 0.5 in bfloat16 (whose 8-bit
# significand cannot tell apart logits closer than 0.125 there).
TIE_ULPS = {"float32": 16, "float16": 4, "bfloat16": 4}
EPSILON = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
END = -1  # the token of a run that ended (end of sequence) where the other went on


def ulp(magnitude: float, dtype: str) -> float:
    """The spacing of `dtype`'s numbers at `magnitude` (a normal number)."""
    return EPSILON[dtype] * 2.0 ** np.floor(np.log2(max(abs(magnitude), 1e-30)))


@dataclass
class Readout:
    """The target's logits at the differing position, computed one way."""

    argmax: int
    runner_up: int
    gap: float  # its top-1 minus top-2 logit
    reference_below_best: float  # how far the reference run's token is below the top logit
    other_below_best: float  # the same for the other run's token
    largest: float  # the largest |logit|: the tolerance's scale


@dataclass
class Identity:
    """A run against the reference run: identical, a tie, or a mismatch."""

    verdict: str  # identical | tie | mismatch
    position: int | None = None  # index into the generated tokens of the first difference
    reference_token: int | None = None  # END where the reference run ended there
    other_token: int | None = None
    one_token: Readout | None = None  # prompt and prefix fed one token at a time, as AR does
    window: Readout | None = None  # the prefix's last token and the run's next ones at once
    window_tokens: int = 0
    dtype: str = ""
    tolerance: float = 0.0
    texts: dict[int, str] = field(default_factory=dict)  # the tokens above, decoded

    @property
    def passed(self) -> bool:
        return self.verdict != "mismatch"

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for a report: where, which tokens, the gaps both ways, the tolerance."""
        if self.verdict == "identical":
            return "identical"

        def name(t: int) -> str:
            return "<end>" if t == END else f"{t} {self.texts.get(t, '')!r}"

        a, w = self.one_token, self.window
        return (f"{self.verdict} at token {self.position}: {name(self.reference_token)} "
                f"(target-only) vs {name(self.other_token)}; the target's top-2 gap "
                f"{a.gap:.3g} one token at a time (best {name(a.argmax)}), {w.gap:.3g} in a "
                f"window of {self.window_tokens} (best {name(w.argmax)}); tolerance "
                f"{self.tolerance:.3g} ({TIE_ULPS[self.dtype]} ulps of {self.dtype})")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(target: LoadedModel, prompt: Sequence[int], reference: Sequence[int],
            other: Sequence[int]) -> Identity:
    """`reference`: target-only greedy decoding's tokens after `prompt`; `other`: another
    greedy run's (same prompt and token limit). Where a run is a prefix of the other it ended
    there: its token is the end of sequence (the target's best end-of-sequence id)."""
    prompt, reference, other = list(prompt), list(reference), list(other)
    if reference == other:
        return Identity("identical")
    if not prompt:
        raise InvalidParameter("compare needs the prompt's token ids")
    i = first_difference(reference, other)
    common = reference[:i]
    one = _one_token_logits(target, prompt, common)
    window_ids = (prompt + common)[-1:] + other[i: i + LONGEST]
    win = _window_logits(target, (prompt + common)[:-1], window_ids)
    dtype = str(one.dtype).removeprefix("mlx.core.")
    one, win = np.array(one.astype(mx.float32)), np.array(win.astype(mx.float32))
    r = _token(reference, i, one, target)
    o = _token(other, i, one, target)
    largest = float(max(np.abs(one).max(), np.abs(win).max()))
    tol = TIE_ULPS[dtype] * ulp(largest, dtype)
    readouts = [_readout(x, r, o) for x in (one, win)]
    tie = all(max(x.reference_below_best, x.other_below_best) <= tol for x in readouts)
    texts = {t: target.tokenizer.decode([t]) for t in {r, o, *(x.argmax for x in readouts)}
             if t != END}
    return Identity("tie" if tie else "mismatch", i, r if i < len(reference) else END,
                    o if i < len(other) else END, *readouts, len(window_ids), dtype, tol,
                    texts)


def _token(tokens: list[int], i: int, logits: np.ndarray, target: LoadedModel) -> int:
    if i < len(tokens):
        return tokens[i]
    eos = sorted(target.eos_token_ids)
    return eos[int(np.argmax(logits[eos]))] if eos else END


def _readout(logits: np.ndarray, reference: int, other: int) -> Readout:
    order = np.argsort(-logits, kind="stable")
    best = float(logits[order[0]])

    def below(t: int) -> float:
        return float("inf") if t == END else best - float(logits[t])

    return Readout(int(order[0]), int(order[1]), best - float(logits[order[1]]),
                   below(reference), below(other), float(np.abs(logits).max()))


def _prefill(target: LoadedModel, ids: list[int]) -> list:
    """A fresh cache holding `ids`, filled as a generation's prefill fills it."""
    cache = split.make_cache(target.model)
    for at in range(0, len(ids), PREFILL_CHUNK):
        split.forward(target.model, mx.array(ids[at: at + PREFILL_CHUNK])[None], cache)
        mx.eval([c.state for c in cache])
    return cache


def _one_token_logits(target: LoadedModel, prompt: list[int], common: list[int]) -> mx.array:
    """Target-only decoding replayed: the prompt prefilled but its last token, then that and
    each common token alone. The logits after the last: what it chose the differing token by."""
    cache = _prefill(target, prompt[:-1])
    for token in prompt[-1:] + common:
        logits = target.model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
    return logits


def _window_logits(target: LoadedModel, before: list[int], window: list[int]) -> mx.array:
    """As verification computes it: `before` prefilled, then `window` in one forward (up to
    the longest verification window, past MLX's 8-query vector kernel). Its first position's
    logits choose the token after the window's first."""
    cache = _prefill(target, before)
    logits, _ = split.forward(target.model, mx.array(window)[None], cache)
    return logits[0, 0]


def summary(results: Sequence[Identity]) -> str:
    """For a report: on how many prompts a run was identical, and each tie or mismatch."""
    same = sum(r.verdict == "identical" for r in results)
    head = (f"identical on {same} prompts" if same == len(results)
            else f"identical on {same} of {len(results)} prompts")
    return "; ".join([head] + [f"prompt {k + 1}: {r.describe()}"
                               for k, r in enumerate(results) if r.verdict != "identical"])
