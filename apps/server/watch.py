"""Why a request should stop before its end: its client left, its time ran out, the server is
stopping. One thread per request watches the socket and the clock while the request waits for
the engine, generates and streams."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Iterator

POLL_S = 0.1


class Stop:
    """A cancel event for the Engine and the first reason it was set for: "gone" (the client
    left), "timeout" (the request's time is up), "behind" (a streaming client stopped reading),
    "shutdown" (the server is stopping)."""

    def __init__(self):
        self.event = threading.Event()
        self.reason: str | None = None
        self._lock = threading.Lock()

    def set(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
                self.event.set()


@contextlib.contextmanager
def watch(sock: socket.socket, deadline: float) -> Iterator[Stop]:
    """A Stop set when the client closes its connection or `deadline` (time.monotonic())
    passes. A closed socket reads as end-of-file; peeking never consumes a byte. A client that
    sends more (a pipelined request) is there: stop watching the socket, keep the clock."""
    stop, done = Stop(), threading.Event()

    def run():
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            watching = True
            while not done.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    stop.set("timeout")
                    return
                if not watching:
                    done.wait(min(left, POLL_S))
                elif selector.select(min(left, POLL_S)):
                    try:
                        if not sock.recv(1, socket.MSG_PEEK):
                            stop.set("gone")
                    except OSError:
                        stop.set("gone")
                    watching = False

    watcher = threading.Thread(target=run, name="request-watch", daemon=True)
    watcher.start()
    try:
        yield stop
    finally:
        done.set()
        watcher.join()
