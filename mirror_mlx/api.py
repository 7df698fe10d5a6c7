"""The public Engine: load once, then generate, stream or chat."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jinja2 import TemplateError

from .decode.mirror import MirrorConfig
from .decode.sampling import SamplingParams
from .draft.load import load_draft, load_exit_head
from .draft.mlx_draft import MLXDrafter
from .errors import InvalidParameter
from .measure.stats import GenerationStats
from .models.load import LoadedModel, load
from .session import Chunk, DecodeSettings, Session

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class Engine:
    """A loaded target, and a draft for the speculative modes, with one conversation session.

    >>> engine = Engine()                      # the default model, target-only
    >>> engine = Engine(mode="mirror")         # Mirror-SD with the default draft
    >>> engine.generate("Name three colors.", max_tokens=32).text
    """

    def __init__(self, model: str | LoadedModel | None = None, *, mode: str = "ar",
                 draft: str | None = None, dtype: str = "auto", context: int | None = None,
                 gamma: int = 5, kappa: int = 8, exit_layer: int | None = None,
                 exit_head: str | None = None, branch_budget: int = 4,
                 branch_source: str = "union", quiet: bool = False):
        if not isinstance(model, LoadedModel):
            model = load(model, dtype=dtype, quiet=quiet)
        self.target = model
        self.drafter = None
        head = load_exit_head(exit_head, model) if mode == "mirror" else None
        layer = head.layer if head else exit_layer or round(model.num_layers * 5 / 6)
        settings = DecodeSettings(mode, gamma, MirrorConfig(
            gamma=gamma, kappa=kappa, exit_layer=layer, budget=branch_budget,
            source=branch_source, exit_head=head))
        settings.check(model.num_layers)
        if mode != "ar":
            self.drafter = MLXDrafter(load_draft(draft, model))
        try:
            self.session = Session(self.target, context, self.drafter, settings)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the draft's worker. The engine cannot generate afterwards."""
        if self.drafter is not None:
            self.drafter.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str | Sequence[Message] | Sequence[int],
               chat_template: bool = True) -> list[int]:
        """Token ids for a prompt: text (wrapped in the chat template as one user turn unless
        `chat_template=False`), a list of chat messages, or ids as they are."""
        if isinstance(prompt, str):
            if not chat_template or self.tokenizer.chat_template is None:
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        prompt = list(prompt)
        if prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if self.tokenizer.chat_template is None:
            raise InvalidParameter(f"{self.target.name} has no chat template; pass plain text")
        try:
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                      tokenize=False)
        except TemplateError as e:
            raise InvalidParameter(f"the chat template of {self.target.name} failed: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: str | Sequence[Message] | Sequence[int], *,
               max_tokens: int = 256, sampling: SamplingParams | None = None,
               stop: Sequence[str] = (), chat_template: bool = True,
               cancel: threading.Event | None = None) -> Iterator[Chunk]:
        ids = self.encode(prompt, chat_template)
        yield from self.session.generate(ids, max_tokens=max_tokens,
                                         sampling=sampling or SamplingParams(), stop=stop,
                                         cancel=cancel)

    def generate(self, prompt: str | Sequence[Message] | Sequence[int], **kwargs) -> Result:
        text, ids, stats = [], [], None
        for chunk in self.stream(prompt, **kwargs):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats or stats
        return Result("".join(text), ids, stats)
