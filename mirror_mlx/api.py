"""The public Engine: load once, then generate, stream or chat; cancel from any thread; one
generation at a time per engine, later calls queued in arrival order."""

from __future__ import annotations

import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from jinja2 import TemplateError

from .decode.length import LONGEST
from .decode.mirror import MirrorConfig
from .decode.sampling import SamplingParams
from .decode.schedule import AUTO_BUDGET
from .decode.stats import GenerationStats
from .draft.base import Drafter
from .draft.known import AUTO
from .draft.load import load_exit_head
from .draft.lookup import LookupDrafter
from .draft.select import make_drafter
from .errors import EngineBusy, EngineClosed, InvalidParameter, MirrorError
from .memory import wiring
from .models import split
from .models.load import LoadedModel, load, materialize
from .session import Chunk, DecodeSettings, Session

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
ROLES = ("system", "user", "assistant")
Prompt = str | Sequence[Message] | Sequence[int]


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: GenerationStats

    @property
    def message(self) -> Message:
        """The reply as a chat message, ready to append to the conversation."""
        return {"role": "assistant", "content": self.text}


def model_name(target: LoadedModel) -> str:
    """A short name for the target: its file or folder name, or a hub id's last part."""
    spec = target.path if target.name == "default" else Path(target.name)
    return spec.stem if spec.suffix == ".gguf" else spec.name


def check_messages(messages: Sequence[Message]) -> None:
    """Chat messages are a non-empty list of {"role", "content"} with a known role and text."""
    if not messages:
        raise InvalidParameter("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidParameter(f"messages[{i}] must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise InvalidParameter(f"messages[{i}].role must be one of {', '.join(ROLES)} "
                                   f"(got {m.get('role')!r})")
        if not isinstance(m.get("content"), str):
            raise InvalidParameter(f"messages[{i}].content must be a string")
        _check_unicode(m["content"], f"messages[{i}].content")


def _check_unicode(text: str, what: str) -> None:
    """Text the tokenizer can take: a lone surrogate (JSON's "\\ud800" decodes to one) is not
    Unicode text, and the tokenizer refuses it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameter(f"{what} is not valid Unicode text: a lone surrogate "
                               f"(U+{ord(text[e.start]):04X}) at character {e.start}") from None


class _Turns:
    """One holder at a time; the others wait in arrival order (a plain Lock is not fair, and a
    server's requests should not overtake each other)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._line: deque[object] = deque()  # tickets of the waiting callers, oldest first
        self.holder: int | None = None  # thread id
        self.running: threading.Event | None = None  # the holder's cancel event

    def enter(self, wait: float | None, cancel: threading.Event | None) -> bool:
        """Take the turn; False when `cancel` was set while waiting. Raises EngineBusy when
        `wait` seconds pass first, or when this thread already holds the turn (waiting would
        deadlock: a stream on this thread is still open)."""
        me, ticket = threading.get_ident(), object()
        with self._cond:
            if self.holder == me:
                raise EngineBusy("this thread is already generating on this engine: finish or "
                                 "close that stream first")
            self._line.append(ticket)
            deadline = None if wait is None else time.monotonic() + wait
            try:
                while self.holder is not None or self._line[0] is not ticket:
                    if cancel is not None and cancel.is_set():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise EngineBusy("the engine is busy with another generation "
                                         f"(waited {wait:g} s)")
                    # A cancel event cannot wake a Condition: look at it a few times a second.
                    self._cond.wait(0.05 if left is None else min(left, 0.05))
            finally:
                self._line.remove(ticket)
                self._cond.notify_all()
            # `running` first: whoever sees the engine busy can cancel what runs.
            self.running = cancel
            self.holder = me
            return True

    def leave(self) -> None:
        with self._cond:
            self.holder = None
            self.running = None
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._line)


class _Worker:
    """The one thread an engine's generations run on. MLX gives every thread that builds arrays
    a stream of its own, served by a thread that lives as long as the process: generating on
    each caller's thread, a server with a thread per request left one thread behind per
    request (benchmarks/reliability.py: +1 thread and its memory per reply). The caller still
    pulls each chunk: a generation never runs ahead of its reader."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="mirror-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn):
        """fn() on the worker: its value, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn()
        done, box = threading.Event(), {}

        def job():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: B036  (the caller's to handle, whatever it is)
                box["error"] = e
            done.set()

        self._jobs.put(job)
        done.wait()
        if "error" in box:
            raise box.pop("error")
        return box["value"]

    def iterate(self, items: Iterator) -> Iterator:
        """The generator `items`, each item computed on the worker; closed there too."""
        try:
            while True:
                try:
                    item = self.call(lambda: next(items))
                except StopIteration:
                    return
                yield item
        finally:
            self.call(items.close)


# Workers of closed (or dropped) engines, for the next engines: a worker's MLX thread outlives
# it, so a program that opens engine after engine reuses them rather than adding threads.
_IDLE_WORKERS: list[_Worker] = []


def _take_worker() -> _Worker:
    try:
        return _IDLE_WORKERS.pop()
    except IndexError:
        return _Worker()


def _drafter(draft: str | Drafter | None, target: LoadedModel, device: str | None) -> Drafter:
    """A spec names a draft (draft/select.py); a Drafter is used as it is."""
    if draft is None or isinstance(draft, str):
        return make_drafter(draft, target, device)
    if device not in (None, "auto"):
        raise InvalidParameter("draft_device places a draft named by its spec; a Drafter "
                               "object runs where it was built")
    return draft


class Engine:
    """A loaded target, and a draft for the speculative modes, with one conversation session.

    One generation runs at a time: a call made while another runs waits for its turn (in
    arrival order) for up to `wait` seconds, then raises EngineBusy; `wait=0` refuses at once.
    `cancel()` stops the running generation from any thread. Several engines may share one
    LoadedModel (e.g. one per mode); each keeps its own session and draft.

    `mode`: "ar" (target only), "sd" or "mirror"; None (the default) is Mirror-SD with the
    draft `draft` stands for, or target-only decoding where no draft can serve the target (its
    reason is said once, on stderr and in `mode_note`).

    >>> engine = Engine()                      # the default model, Mirror-SD
    >>> engine = Engine(mode="ar")             # target-only
    >>> engine.generate("Name three colors.", max_tokens=32).text
    """

    def __init__(self, model: str | LoadedModel | None = None, *, mode: str | None = None,
                 draft: str | Drafter | None = "auto", dtype: str = "auto",
                 context: int | None = None,
                 gamma: int | None = None, kappa: int = 8, exit_layer: int | None = None,
                 exit_head: str | None = None, branch_budget: int | None = None,
                 branch_source: str = "union", lookup: bool = True,
                 separate_units: bool = False, draft_device: str | None = None,
                 hosts: str | None = None, hostfile: str | None = None,
                 parallel: str = "auto", split_layers: str | None = None,
                 ring_port: int = 32323, rank_timeout: float = 120.0,
                 quiet: bool = False):
        """`hosts` ("IP,IP,...") or `hostfile` (mlx.launch's JSON hostfile) split the target
        over ranks, as the CLI's --hosts, --hostfile, --parallel, --split, --ring-port and
        --rank-timeout do. This program then runs again on every rank through mlx.launch:
        the process that called Engine(hosts=...) waits for the run and exits with its status;
        on rank 0 the call returns the engine; on the others it serves rank 0's forwards
        and exits when rank 0's engine closes. What the program does before this call, every
        rank does."""
        self._turns = _Turns()
        self._closed = False
        self._closing = threading.Lock()
        self._wired = False
        self.drafter = None
        self._ranks = ExitStack()
        remote = None
        if hosts or hostfile:
            if isinstance(model, LoadedModel):
                raise InvalidParameter("with hosts, every rank loads the target itself: name "
                                       "it (a path or a model id) instead of passing it loaded")
            from .distributed.run import Options, engine_ranks

            model, remote = self._ranks.enter_context(engine_ranks(
                model, dtype, hosts, hostfile, Options(parallel, split_layers, rank_timeout),
                ring_port, quiet))
        try:
            if not isinstance(model, LoadedModel):
                model = load(model, dtype=dtype, quiet=quiet)
            self.target = model
            self.mode_note = ""  # why the default mode runs target-only, if it does
            if mode is None:
                mode = "mirror"
                try:
                    self.drafter = _drafter(draft, model, draft_device)
                except MirrorError as e:
                    if draft not in (None, AUTO) or draft_device not in (None, "auto"):
                        raise  # a draft the caller named must serve, or say why not
                    mode, self.mode_note = "ar", f"running target-only (AR): {e}"
                    if not quiet:
                        print(self.mode_note, file=sys.stderr, flush=True)
            self._make_session(mode, draft, draft_device, context, gamma, kappa, exit_layer,
                               exit_head, branch_budget, branch_source, lookup, separate_units)
            materialize(self.target.model)
            self._worker = _take_worker()
            # Given back once: by close(), or when an engine dropped without close() is collected.
            self._give_back = weakref.finalize(self, _IDLE_WORKERS.append, self._worker)
            # Keep the weights resident between turns (where the platform wires memory: see
            # platform.wired_limit_bytes); close() lets them go.
            wiring.hold()
            self._wired = True
            # Loading converts weights (a GGUF dequantized, a dtype cast) and leaves what it freed
            # in MLX's buffer cache: ~300 MB with the default model and its draft in float32.
            mx.clear_cache()
            if remote is not None:
                from .distributed.run import want_layers

                want_layers(remote, self)
        except BaseException:
            self._release()
            raise

    def _make_session(self, mode, draft, draft_device, context, gamma, kappa, exit_layer,
                      exit_head, branch_budget, branch_source, lookup, separate_units) -> None:
        """The decoding settings, the draft (unless made already) and the session."""
        model = self.target
        head = load_exit_head(exit_head, model, exit_layer) if mode == "mirror" else None
        layer = head.layer if head else exit_layer or round(model.num_layers * 5 / 6)
        settings = DecodeSettings(mode, gamma, MirrorConfig(
            kappa=kappa, exit_layer=layer, budget=branch_budget,
            source=branch_source, exit_head=head, separate_units=separate_units))
        settings.check(model.num_layers)
        if mode != "ar":
            if self.drafter is None:
                self.drafter = _drafter(draft, model, draft_device)
            if mode == "mirror":
                # The exit reads out only the tokens the draft's head knows (split.ExitVocab).
                ids = self.drafter.head_ids
                if len(ids) < model.vocab_size:
                    settings.mirror.exit_vocab = split.ExitVocab.of(model.model, ids)
            if lookup:
                self.drafter = LookupDrafter(self.drafter)
            if self.drafter.context is not None:
                # The draft's cache also holds the window and the branches rolled out beside it.
                budget = AUTO_BUDGET if branch_budget is None else branch_budget
                window = gamma or LONGEST
                room = self.drafter.context - (budget + 1) * (2 * window + 2)
                context = min(context or model.context_length, room)
        self.session = Session(self.target, context, self.drafter, settings)

    @property
    def mode(self) -> str:
        return self.session.settings.mode

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def busy(self) -> bool:
        """A generation holds the engine."""
        return self._turns.holder is not None

    @property
    def waiting(self) -> int:
        """Calls waiting for their turn behind the running one."""
        return self._turns.waiting

    def cancel(self) -> None:
        """Stop the running generation (from any thread); it ends after its current step with
        finish_reason "cancelled". Waiting calls still run; a no-op when nothing runs."""
        running = self._turns.running
        if running is not None:
            running.set()

    def close(self) -> None:
        """Cancel the running generation, wait for it to end, stop the draft's worker, and
        put back the wired memory limit this engine raised (on macOS with Metal). Idempotent;
        later generation calls raise EngineClosed."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.cancel()
        if self._turns.holder == threading.get_ident():
            return  # closed from inside a stream on this thread: its end releases the draft
        self._turns.enter(None, None)
        try:
            self._release()
        finally:
            self._turns.leave()

    def _release(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
        if hasattr(self, "_give_back"):
            self._give_back()
        # A stream's end and close() on another thread may both get here: release once.
        with self._closing:
            wired, self._wired = self._wired, False
        if wired:
            wiring.release()
        self._ranks.close()  # over ranks: stop the others

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: Prompt, chat_template: bool = True) -> list[int]:
        """Token ids for a prompt: text (wrapped in the chat template as one user turn unless
        `chat_template=False`), a list of chat messages, or ids as they are."""
        if isinstance(prompt, str):
            _check_unicode(prompt, "the prompt")
            if not chat_template or self.tokenizer.chat_template is None:
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, Sequence):
            raise InvalidParameter("a prompt is text, a list of chat messages or token ids "
                                   f"(got {type(prompt).__name__})")
        prompt = list(prompt)
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise InvalidParameter(f"token id {bad[0]} is outside the vocabulary "
                                       f"(0..{self.target.vocab_size - 1})")
            return prompt
        check_messages(prompt)
        if self.tokenizer.chat_template is None:
            raise InvalidParameter(f"{self.target.name} has no chat template; pass plain text")
        try:
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                      tokenize=False)
        except TemplateError as e:
            raise InvalidParameter(f"the chat template of {self.target.name} failed: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: Prompt, *, max_tokens: int = 256,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (),
               chat_template: bool = True, cancel: threading.Event | None = None,
               wait: float | None = None) -> Iterator[Chunk]:
        """Stream the reply: chunks of text with their token ids; the last chunk carries the
        stats. The prompt is encoded now; the generation takes its turn (waiting up to `wait`
        seconds, None = as long as it takes) when iteration starts, and holds the engine until
        the stream is exhausted or closed. Setting `cancel` stops it, also while it waits for
        its turn; `engine.cancel()` stops it once it runs."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        ids = self.encode(prompt, chat_template)
        self.session.check(ids, max_tokens)
        return self._run(ids, max_tokens, sampling or SamplingParams(), tuple(stop),
                         cancel or threading.Event(), wait)

    def _run(self, ids, max_tokens, sampling, stop, cancel, wait) -> Iterator[Chunk]:
        if not self._turns.enter(wait, cancel):
            yield Chunk("", [], GenerationStats(mode=self.mode, prompt_tokens=len(ids),
                                                finish_reason="cancelled"))
            return
        try:
            if self._closed:
                raise EngineClosed("the engine was closed")
            yield from self._worker.iterate(self.session.generate(
                ids, max_tokens=max_tokens, sampling=sampling, stop=stop, cancel=cancel))
        finally:
            self._turns.leave()
            if self._closed:
                self._release()

    def generate(self, prompt: Prompt, **kwargs) -> Result:
        """The whole reply at once; takes the keyword arguments of `stream`."""
        text, ids, stats = [], [], None
        for chunk in self.stream(prompt, **kwargs):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats or stats
        return Result("".join(text), ids, stats)

    def chat(self, messages: Sequence[Message], **kwargs) -> Result:
        """Messages in, the assistant's reply out (`result.message`); takes the keyword
        arguments of `stream`. The session's cache keeps the conversation, so appending the
        reply and the next user message reuses everything before them."""
        if isinstance(messages, str) or not isinstance(messages, Sequence):
            raise InvalidParameter("chat takes a list of messages; use generate for text")
        check_messages(messages)
        return self.generate(messages, **kwargs)
