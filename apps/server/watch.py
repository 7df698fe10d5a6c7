"""Why a request should stop before its end: its client left, its time ran out, the server is
stopping. One thread per request watches the socket and the clock while the request waits for
the engine, generates and streams."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator

POLL_S = 0.1


class Stop:
    """A cancel event for the Engine and the first reason it was set for: "gone" (the client
    left), "timeout" (the request's time is up), "behind" (a streaming client stopped reading),
    "shutdown" (the server is stopping)."""

    def __init__(self):
        self.event = threading.Event()
        self.reason: str | None = None
        self.extra = 0  # bytes the client sent after its request
        self._lock = threading.Lock()

    def set(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
                self.event.set()


@contextlib.contextmanager
def watch(sock: socket.socket, deadline: float, probe: Callable[[], bool],
          max_extra: int) -> Iterator[Stop]:
    """A Stop set when the client leaves or `deadline` (time.monotonic()) passes.

    Bytes the client sends after its request (pipelining, or noise) are read and dropped, so
    that a hang-up behind them still shows; `stop.extra` counts them (the connection is closed
    after the reply, its stream no longer in step), and more than `max_extra` count as gone.

    End-of-file means the client closed, or only shut its sending side and still waits for the
    reply: TCP cannot tell these apart without sending. `probe()` sends something harmless (an
    interim response) or returns False when it cannot; a closed client's kernel answers with a
    reset, which the socket's pending error (SO_ERROR) then shows."""
    stop, done = Stop(), threading.Event()

    def run():
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            ended = False  # end-of-file seen: from here on the socket reads as ready forever
            while not done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    stop.set("timeout")
                    return
                if ended:
                    done.wait(min(left, POLL_S))
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        stop.set("gone")
                        return
                elif selector.select(min(left, POLL_S)):
                    try:
                        data = sock.recv(1 << 16)
                    except OSError:
                        stop.set("gone")
                        return
                    stop.extra += len(data)
                    if stop.extra > max_extra:
                        stop.set("gone")
                        return
                    if not data:
                        ended = True
                        if not probe():
                            stop.set("gone")
                            return

    watcher = threading.Thread(target=run, name="request-watch", daemon=True)
    watcher.start()
    try:
        yield stop
    finally:
        done.set()
        watcher.join()
