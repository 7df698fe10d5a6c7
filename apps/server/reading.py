"""A connection's incoming bytes under one deadline per request: a socket timeout restarts with
every byte, so a client trickling its headers a byte at a time would hold a thread forever."""

from __future__ import annotations

import io
import socket
import time


class DeadlineReader(io.RawIOBase):
    """The raw reader under the handler's buffered `rfile`. Before each request, `expect` sets
    how long the first byte may take (`idle`); from that byte on, the request's headers and
    body together have `limit` seconds."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.idle = self.limit = 0.0
        self.deadline: float | None = None
        self.began: float | None = None  # time.monotonic() of the request's first byte

    def expect(self, idle: float, limit: float) -> None:
        self.idle, self.limit = idle, limit
        self.deadline = self.began = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        timeout = self.idle if self.deadline is None else self.deadline - time.monotonic()
        if timeout <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(timeout)
        n = self.sock.recv_into(buffer)
        if n and self.deadline is None:
            self.began = time.monotonic()
            self.deadline = self.began + self.limit
        return n
