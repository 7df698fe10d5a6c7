"""The chat window: a transcript, an input line, Send and Stop, the mode switch, live stats.

Tk is not thread-safe, so only the main thread touches widgets. A worker thread owns the
engine and the conversation (replies, mode switches, in order) and hands events back through
a queue that the main loop polls with `after`. Stop calls Engine.cancel(), which is safe from
any thread. A mode switch builds a new Engine on the same loaded target (no reload) and
closes the old one."""

from __future__ import annotations

import queue
import threading
import time
import tkinter as tk
from tkinter import ttk

from mirror_mlx.api import Engine, Message, model_name
from mirror_mlx.chat import fit_to_context
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.decode.stats import GenerationStats
from mirror_mlx.errors import MirrorError
from mirror_mlx.models.load import LoadedModel

MODES = {"ar": "AR", "sd": "SD", "mirror": "Mirror-SD"}
POLL_MS = 30


class ChatWindow:
    def __init__(self, root: tk.Tk, target: LoadedModel, *, mode: str | None = None,
                 max_tokens: int = 512, sampling: SamplingParams | None = None,
                 system: str | None = None, **engine_options):
        """`engine_options`: the Engine's keyword arguments (draft, context, gamma, ...)."""
        self.root = root
        self.target = target
        self.engine_options = engine_options
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingParams()
        self.engine = Engine(target, mode=mode, **engine_options)
        self.messages: list[Message] = [{"role": "system", "content": system}] if system else []
        self.tasks: queue.Queue = queue.Queue()  # main -> worker: ("reply", text), ("mode", m)
        self.events: queue.Queue = queue.Queue()  # worker -> main: (kind, payload)
        self.generating = False
        self.last_stats: GenerationStats | None = None
        self._closed = False
        self._live = (0.0, 0, 0)  # first token time, tokens, steps (chunks with tokens)
        self._build(self.engine.mode)
        self.worker = threading.Thread(target=self._work, name="chat-worker", daemon=True)
        self.worker.start()
        root.protocol("WM_DELETE_WINDOW", self.close)
        root.after(POLL_MS, self._poll)

    # ---- widgets (main thread)
    def _build(self, mode: str) -> None:
        root = self.root
        root.title(f"mirror-mlx chat — {model_name(self.target)}")
        root.geometry("720x480")
        top = ttk.Frame(root, padding=(8, 6))
        top.pack(fill="x")
        ttk.Label(top, text="Mode:").pack(side="left")
        self.mode_var = tk.StringVar(value=mode)
        self.mode_buttons = {}
        for key, label in MODES.items():
            b = ttk.Radiobutton(top, text=label, value=key, variable=self.mode_var,
                                command=self._switch_mode)
            b.pack(side="left", padx=4)
            self.mode_buttons[key] = b
        ttk.Label(top, text=f"{model_name(self.target)} ({self.target.dtype})",
                  foreground="#555").pack(side="right")

        self.status = tk.StringVar(value="ready")
        ttk.Label(root, textvariable=self.status, padding=(8, 2), anchor="w",
                  relief="sunken").pack(side="bottom", fill="x")
        bottom = ttk.Frame(root, padding=(8, 6))
        bottom.pack(side="bottom", fill="x")
        self.entry = ttk.Entry(bottom)
        self.entry.pack(side="left", fill="x", expand=True)
        self.entry.bind("<Return>", lambda _: self.send())
        self.send_button = ttk.Button(bottom, text="Send", command=self.send)
        self.send_button.pack(side="left", padx=(6, 0))
        self.stop_button = ttk.Button(bottom, text="Stop", command=self.stop, state="disabled")
        self.stop_button.pack(side="left", padx=(6, 0))

        self.transcript = tk.Text(root, wrap="word", state="disabled", padx=8, pady=6,
                                  height=10, font="TkTextFont")
        self.transcript.pack(fill="both", expand=True, padx=8)
        self.transcript.tag_configure("user", foreground="#1a4e8a")
        self.transcript.tag_configure("who", font="TkHeadingFont")
        self.transcript.tag_configure("note", foreground="#888")
        self.transcript.tag_configure("error", foreground="#b00020")
        self.entry.focus_set()

    def _write(self, text: str, tag: str | tuple[str, ...] = ()) -> None:
        self.transcript.configure(state="normal")
        self.transcript.insert("end", text, tag)
        self.transcript.configure(state="disabled")
        self.transcript.see("end")

    def send(self) -> None:
        text = self.entry.get().strip()
        if not text or self.generating:
            return
        self.entry.delete(0, "end")
        self._write("You: ", ("user", "who"))
        self._write(f"{text}\n", "user")
        self._set_generating(True)
        self.tasks.put(("reply", text))

    def stop(self) -> None:
        self.engine.cancel()

    def _switch_mode(self) -> None:
        mode = self.mode_var.get()
        if mode == self.engine.mode:
            return
        self.engine.cancel()  # a running reply ends now; the switch follows it
        for b in self.mode_buttons.values():
            b.configure(state="disabled")
        self.status.set(f"switching to {MODES[mode]}…")
        self.tasks.put(("mode", mode))

    def _set_generating(self, on: bool) -> None:
        self.generating = on
        self.send_button.configure(state="disabled" if on else "normal")
        self.stop_button.configure(state="normal" if on else "disabled")

    def _poll(self) -> None:
        while True:
            try:
                kind, payload = self.events.get_nowait()
            except queue.Empty:
                break
            getattr(self, f"_on_{kind}")(payload)
        if not self._closed:
            self.root.after(POLL_MS, self._poll)

    def _on_start(self, _) -> None:
        self._live = (0.0, 0, 0)
        self._write("Assistant: ", "who")

    def _on_chunk(self, chunk) -> None:
        self._write(chunk.text)
        if not chunk.token_ids:
            return
        first, tokens, steps = self._live
        now = time.perf_counter()
        if not tokens:
            first = now
        tokens, steps = tokens + len(chunk.token_ids), steps + 1
        self._live = (first, tokens, steps)
        # The session yields one chunk per target step, so tokens per chunk is tokens per step.
        rate = (tokens - 1) / (now - first) if now > first else 0.0
        self.status.set(f"{MODES[self.engine.mode]} · {rate:.1f} tok/s · "
                        f"{tokens / steps:.2f} tok/step · {tokens} tokens")

    def _on_done(self, stats: GenerationStats | None) -> None:
        self._set_generating(False)
        if stats is None:
            return
        self.last_stats = stats
        self._write("\n")
        if stats.finish_reason == "cancelled":
            self._write("[stopped]\n", "note")
        self.status.set(f"{MODES[stats.mode]} · {stats.tokens_per_second:.1f} tok/s · "
                        f"{stats.acceptance_length:.2f} tok/step · "
                        f"{stats.generated_tokens} tokens · finish {stats.finish_reason}")

    def _on_mode(self, mode: str) -> None:
        self.mode_var.set(mode)
        for b in self.mode_buttons.values():
            b.configure(state="normal")
        self.status.set(f"mode {MODES[mode]}")

    def _on_note(self, text: str) -> None:
        self._write(f"[{text}]\n", "note")

    def _on_error(self, text: str) -> None:
        self._write(f"[error: {text}]\n", "error")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.cancel()
        self.tasks.put(None)
        self.worker.join()
        self.root.destroy()

    # ---- the worker thread: the only one that generates or replaces the engine
    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            kind, arg = task
            try:
                if kind == "reply":
                    self._reply(arg)
                else:
                    self._switch(arg)
            except MirrorError as e:
                self.events.put(("error", str(e)))
        self.engine.close()

    def _reply(self, text: str) -> None:
        stats = None
        try:
            self.messages.append({"role": "user", "content": text})
            ids = fit_to_context(self.engine, self.messages, room=min(self.max_tokens, 64),
                                 say=lambda s: self.events.put(("note", s.strip("[]"))))
            if ids is None:
                self.messages.pop()
                raise MirrorError(f"that message does not fit in the "
                                  f"{self.engine.session.context}-token context")
            self.events.put(("start", None))
            pieces = []
            for chunk in self.engine.stream(ids, max_tokens=self.max_tokens,
                                            sampling=self.sampling):
                pieces.append(chunk.text)
                stats = chunk.stats or stats
                self.events.put(("chunk", chunk))
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
        finally:
            self.events.put(("done", stats))

    def _switch(self, mode: str) -> None:
        try:
            engine = Engine(self.target, mode=mode, **self.engine_options)
        except MirrorError:
            self.events.put(("mode", self.engine.mode))  # the switch failed: stay
            raise
        old, self.engine = self.engine, engine
        old.close()
        self.events.put(("mode", mode))
