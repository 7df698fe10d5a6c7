"""OpenAI request bodies -> a checked Request, or a RequestError that becomes a 4xx reply.

Like OpenAI's API, unknown fields are refused (a typo should not be silently ignored), and
options this engine cannot honour are accepted only at their neutral value."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mirror_mlx.api import ROLES, Message
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.errors import InvalidParameter

MAX_STOP = 4  # OpenAI's limit on stop sequences
# Characters in one: the text that could still begin one is held back and searched at every
# token, so its length bounds each token's work.
MAX_STOP_CHARS = 256


@dataclass
class RequestError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    prompt: str | list[Message] | list[int]  # messages for chat; text or token ids otherwise
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage


# Accepted and ignored: they only label the request.
_LABELS = ("model", "user", "metadata", "store", "service_tier")
# Accepted only at the value that changes nothing.
_NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
            "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
            "echo": (False,), "best_of": (1,), "suffix": (None, ""), "tools": (None, []),
            "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
            "parallel_tool_calls": (None, False, True)}
_COMMON = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
           "stream_options", *_LABELS}
_FIELDS = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "n", "presence_penalty",
                       "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "tools",
                       "tool_choice", "response_format", "parallel_tool_calls"},
    "completion": _COMMON | {"prompt", "n", "presence_penalty", "frequency_penalty", "logprobs",
                             "logit_bias", "echo", "best_of", "suffix"},
}


def _bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, message, param, code)


def _number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    # An integer too large for a float (JSON allows any) is compared exactly, not converted.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)):
        raise _bad(f"'{name}' must be a number", name)
    if value < low or value > high or (low_open and value == low):
        shown = str(value) if len(str(value)) <= 32 else f"{str(value)[:16]}..."
        raise _bad(f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}] "
                   f"(got {shown})", name)
    return value


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if value < low:
        raise _bad(f"'{name}' must be at least {low} (got {value})", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop")
    if not stop:
        return []  # an empty list: no stop sequences
    if len(stop) > MAX_STOP:
        raise _bad(f"'stop' takes at most {MAX_STOP} sequences (got {len(stop)})", "stop")
    longest = max(len(s) for s in stop)
    if longest > MAX_STOP_CHARS:
        raise _bad(f"a stop sequence may have at most {MAX_STOP_CHARS} characters (got "
                   f"{longest})", "stop")
    return stop


def _messages(body: dict) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with 'role' and 'content'", where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _bad(f"{where}: unsupported field '{sorted(extra)[0]}'", where)
        if m.get("role") not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)} (got {m.get('role')!r})",
                       f"{where}.role")
        out.append({"role": m["role"], "content": _content(m.get("content"), where)})
    return out


def _content(content, where: str) -> str:
    """Text content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]: only text parts are supported",
                           f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _prompt(body: dict) -> str | list[int]:
    """A completion prompt: text, a list of one text, or token ids (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and \
            all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _bad("one prompt per request (a list of prompts is not supported)", "prompt")
    raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")


def parse(kind: str, body, max_tokens: int) -> Request:
    """Check a decoded JSON body for `kind` ("chat" or "completion"); `max_tokens` is the
    server's ceiling on the reply's length."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise _bad(f"unrecognized request argument: {unknown[0]}", unknown[0])
    for name in _LABELS:
        if name in ("metadata", "store") or body.get(name) is None:
            continue
        if not isinstance(body[name], str):
            raise _bad(f"'{name}' must be a string", name)
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if name in body and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                    for v in neutral):
            shown = " or ".join(repr(v) for v in neutral)
            raise _bad(f"'{name}' is not supported by this server (only {shown})", name)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("'stream_options' must be an object like {\"include_usage\": true}",
                   "stream_options")
    asked, name = _integer(body, "max_tokens", 1), "max_tokens"
    newer = _integer(body, "max_completion_tokens", 1) if kind == "chat" else None
    if newer is not None:
        asked, name = newer, "max_completion_tokens"
    if asked is not None and asked > max_tokens:
        # Refused, not cut short: a client that asked for more should not take a shorter
        # reply for a whole one.
        raise _bad(f"'{name}' is {asked}; this server allows at most {max_tokens} (its "
                   "--max-tokens)", name)
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
            top_k=_integer(body, "top_k", 0) or 0,
            min_p=_number(body, "min_p", 0.0, 0.0, 0.999999),
            seed=_integer(body, "seed", 0))
    except InvalidParameter as e:
        raise _bad(str(e)) from e
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    return Request(kind, prompt, asked or max_tokens, sampling, _stop(body), stream,
                   bool(options.get("include_usage", False)))
