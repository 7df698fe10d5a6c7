"""Replies in OpenAI's shapes: whole completions, streamed chunks, usage, the model list.
The speculative statistics travel beside them in `mirror_stats` (public_stats)."""

from __future__ import annotations

import time
import uuid

from mirror_mlx.decode.stats import GenerationStats

from .request import Request

# Whether a prompt's start was cached says what an earlier client asked (the engine keeps the
# last conversation): not told to a client.
_PRIVATE = ("cached_prompt_tokens", "prompt_tokens_per_second")

# The session's and the server's reasons -> OpenAI's: running out of context or of the
# request's time is a length limit to a client; a server stopping or a client that stopped
# reading ("behind") cancels.
_FINISH = {"stop": "stop", "length": "length", "context": "length", "timeout": "length",
           "cancelled": "cancelled", "shutdown": "cancelled", "behind": "cancelled"}


class Reply:
    """One request's identity: the id, creation time and model every piece of it repeats."""

    def __init__(self, request: Request, model: str):
        self.request = request
        self.model = model
        chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, stats: GenerationStats) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason(stats)}
        if self.request.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(self.object), "choices": [choice], "usage": usage(stats),
                "mirror_stats": public_stats(stats)}

    def chunk(self, text: str | None = None, stats: GenerationStats | None = None) -> dict:
        """A streamed piece: text, or the end (finish_reason and mirror_stats) when `stats`."""
        if self.request.kind == "chat":
            delta = {} if text is None else {"content": text}
            if text == "":
                delta["role"] = "assistant"  # the opening chunk
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason(stats) if stats else None
        out = {**self._head(self.object + ".chunk" if self.request.kind == "chat"
                            else self.object), "choices": [choice]}
        if stats:
            out["mirror_stats"] = public_stats(stats)
        return out

    def usage_chunk(self, stats: GenerationStats) -> dict:
        """The last chunk when stream_options.include_usage: no choices, only usage."""
        obj = self.object + ".chunk" if self.request.kind == "chat" else self.object
        return {**self._head(obj), "choices": [], "usage": usage(stats),
                "mirror_stats": public_stats(stats)}


def public_stats(stats: GenerationStats) -> dict:
    """The GenerationStats a client sees (`mirror_stats`)."""
    return {k: v for k, v in stats.to_dict().items() if k not in _PRIVATE}


def finish_reason(stats: GenerationStats) -> str:
    return _FINISH.get(stats.finish_reason, stats.finish_reason)


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "mirror-mlx"}
