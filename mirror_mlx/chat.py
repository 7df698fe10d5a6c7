"""The terminal chat: multi-turn history, /commands, Ctrl-C that stops a reply but keeps the
session, and a way on when the context is full."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

from .api import Engine, Message
from .decode.sampling import SamplingParams
from .decode.stats import GenerationStats
from .errors import InvalidParameter, MirrorError

HELP = """Commands:
  /reset   forget the conversation (and its cache)
  /stats   statistics of the last reply
  /help    this help
  /quit    leave (Ctrl-D too)
Ctrl-C stops the current reply; the conversation goes on."""


def fit_to_context(engine: Engine, messages: list[Message], room: int,
                   say: Callable[[str], None]) -> list[int] | None:
    """Token ids of the conversation, dropping the oldest exchanges until it leaves `room`
    tokens free. None when the newest message alone does not fit."""
    limit = engine.session.context - room
    ids = engine.encode(messages)
    dropped = 0
    while len(ids) > limit:
        first = 1 if messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            return None
        # Drop the oldest user turn and the reply that followed it.
        del messages[first : first + 2]
        dropped += 1
        ids = engine.encode(messages)
    if dropped:
        say(f"[context full: dropped the {dropped} oldest exchange(s) to make room]")
    return ids


class _Interrupts:
    """Ctrl-C at the prompt clears the line; anywhere else it cancels the current reply, which
    the generation loop notices between steps (no exception lands inside a cache update)."""

    def __init__(self):
        self.at_prompt = False
        self.cancel = threading.Event()

    def __call__(self, *_):
        if self.at_prompt:
            raise KeyboardInterrupt
        self.cancel.set()

    def read(self, prompt: str) -> str:
        try:
            self.at_prompt = True
            line = input(prompt)
            self.cancel = threading.Event()  # a Ctrl-C from here on stops the coming reply
            return line
        finally:
            self.at_prompt = False


def run_chat(engine: Engine, sampling: SamplingParams, max_tokens: int,
             system: str | None = None, stop: tuple[str, ...] = ()) -> None:
    if engine.tokenizer.chat_template is None:
        raise InvalidParameter(
            f"{engine.target.name} has no chat template: it is a completion model, not a chat "
            "model. Give it text to continue with: mirror-mlx generate --prompt TEXT")
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    interrupts = _Interrupts()
    previous = signal.signal(signal.SIGINT, interrupts)
    try:
        _converse(engine, sampling, max_tokens, system, stop, interrupts)
    finally:
        signal.signal(signal.SIGINT, previous)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _converse(engine, sampling, max_tokens, system, stop, interrupts: _Interrupts) -> None:
    def fresh() -> list[Message]:
        return [{"role": "system", "content": system}] if system else []

    _say(f"mirror-mlx chat — {engine.target.name} ({engine.target.dtype}), "
         f"context {engine.session.context} tokens. /help for commands.")
    messages = fresh()
    last: GenerationStats | None = None
    while True:
        try:
            text = interrupts.read(">>> ").strip()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            _say("(/quit or Ctrl-D to leave)")
            continue
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/quit", "/exit"):
                return
            if command == "/reset":
                messages = fresh()
                engine.session.reset()
                _say("[conversation reset]")
            elif command == "/stats":
                _say(last.summary() if last else "[no reply yet]")
            elif command == "/help":
                _say(HELP)
            else:
                _say(f"unknown command {command}; /help lists them")
            continue

        messages.append({"role": "user", "content": text})
        ids = fit_to_context(engine, messages, room=min(max_tokens, 64), say=_say)
        if ids is None:
            messages.pop()
            _say(f"[that message does not fit in the {engine.session.context}-token context; "
                 "shorten it, or start mirror-mlx chat with a larger --context]")
            continue
        reply, last = _reply(engine, ids, sampling, max_tokens, stop, interrupts.cancel)
        messages.append({"role": "assistant", "content": reply})


def _reply(engine, ids, sampling, max_tokens, stop, cancel) -> tuple[str, GenerationStats]:
    pieces: list[str] = []
    stats = None
    try:
        for chunk in engine.stream(ids, max_tokens=max_tokens, sampling=sampling,
                                   stop=stop, cancel=cancel):
            print(chunk.text, end="", flush=True)
            pieces.append(chunk.text)
            stats = chunk.stats or stats
    except MirrorError as e:
        _say(f"\n[error: {e}]")
    print()
    if stats and stats.finish_reason == "cancelled":
        _say("[stopped]")
    elif stats and stats.finish_reason == "context":
        _say("[context full: the reply was cut; older turns will be dropped next time, "
             "or /reset to start over]")
    elif stats and stats.finish_reason == "length":
        _say(f"[reply cut at {max_tokens} tokens; raise --max-tokens for longer replies]")
    return "".join(pieces), stats
