"""The Core ML runtime in a process of its own, so that a draft which hangs or crashes costs
the generation its draft and nothing more.

In the app's process it could cost everything: predict holds the GIL for the whole Core ML call
(APPLE_APIS fact 1), so no thread could give up on a predict that never returns, and Core ML's
open input bug (fact 2) crashes the process it runs in. Here the child owns the model and its
states; the parent waits on a pipe without the GIL (the target's dispatched work and the app's
threads run meanwhile), stops the child when a call passes its bound, and raises: a predict that
hangs is a TimeoutError, a child that died is DraftLost, an error inside the call a
RuntimeError, each met by the session as a draft fault (target-only decoding goes on).

Inputs and outputs cross the pipe pickled: per call, the inputs of one enumerated query length
and the logits over the draft's head (docs/measurements.md gives the round trip).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from socket import socketpair
from typing import Any

import numpy as np

from .base import DRAFT_WAIT_S, DraftLost
from .coreml_package import INPUT_HOLD_S

START_WAIT_S = 600.0  # loading a package specialises it for the Neural Engine: minutes at worst


class ProcessRuntime:
    """A Runtime (coreml_draft.Runtime) whose model lives in a child process. `factory` builds
    the model there: a picklable callable (a module-level function, or a partial of one)."""

    def __init__(self, factory: Callable[[], Any], wait_s: float = DRAFT_WAIT_S):
        self.wait_s = wait_s
        self._lost = ""
        self._owed = False  # a call was interrupted (Ctrl-C) before its reply was read
        mine, theirs = socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._child = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve; serve({theirs.fileno()})"],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(mine.detach())
        try:
            self._call(factory, wait=START_WAIT_S)
        except BaseException:
            self.close()
            raise

    def make_state(self) -> RemoteState:
        return RemoteState(self, self._call("state"))

    def predict(self, inputs: dict[str, np.ndarray], state: RemoteState) -> dict[str, np.ndarray]:
        return self._call("predict", state.index, inputs)

    def close(self) -> None:
        self._stop("the Core ML draft was closed")

    def _call(self, *message, wait: float | None = None) -> Any:
        if self._lost:
            raise DraftLost(self._lost)
        wait = self.wait_s if wait is None else wait
        try:
            if self._owed:  # the interrupted call's reply comes first: it is not this one's
                self._reply(wait)
            self._send(message)
            status, value = self._reply(wait)
        except (EOFError, OSError):
            self._stop(f"the Core ML draft's process ended ({self._ending()})")
            raise DraftLost(self._lost) from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (EOFError, OSError):
            raise
        except BaseException:  # cut off inside a message, which the child cannot then read
            self._stop("the Core ML draft was interrupted while it was sent a call")
            raise
        self._owed = True

    def _reply(self, wait: float) -> tuple[str, Any]:
        if not self._conn.poll(wait):
            self._stop(f"the Core ML draft did not return within {wait:g} s; its process was "
                       "stopped")
            raise TimeoutError(self._lost)
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            raise
        except BaseException:  # cut off inside a reply: what follows cannot be read
            self._stop("the Core ML draft was interrupted while it replied")
            raise
        self._owed = False
        return reply

    def _ending(self) -> str:
        try:
            code = self._child.wait(5)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"

    def _stop(self, why: str) -> None:
        if self._lost:
            return
        self._lost = why
        self._conn.close()
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()


class RemoteState:
    """A model state in the child, with the read_state / write_state of coremltools' MLState."""

    def __init__(self, runtime: ProcessRuntime, index: int):
        self.runtime, self.index = runtime, index

    def read_state(self, name: str) -> np.ndarray:
        return self.runtime._call("read", self.index, name)

    def write_state(self, name: str, value: np.ndarray) -> None:
        self.runtime._call("write", self.index, name, value)


def serve(fd: int) -> None:
    """The child: build the model, then answer calls until the parent closes the pipe."""
    conn = Connection(fd)
    states: list = []
    held: deque = deque()  # (when predict returned, its inputs): Core ML may read them ~1 s more
    try:
        model = conn.recv()[0]()
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe, or is gone
        try:
            if op == "state":
                states.append(model.make_state())
                value = len(states) - 1
            elif op == "predict":
                value = model.predict(args[1], states[args[0]])
                now = time.perf_counter()
                held.append((now, args[1]))
                while now - held[0][0] > INPUT_HOLD_S:
                    held.popleft()
            elif op == "read":
                value = states[args[0]].read_state(args[1])
            else:
                value = states[args[0]].write_state(args[1], args[2])
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        else:
            conn.send(("ok", value))
