"""A stream's events written from a thread of their own, so that the engine, which one request
at a time holds, never waits on a client that reads slowly."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .watch import Stop


class EventSender:
    """Events wait in a buffer of at most `limit` bytes while `write` sends them. A client that
    lets the buffer fill has fallen behind: `stop` is set ("behind") and later text is dropped;
    the closing events still go out. A failed write (the client left, or stalled past the
    socket's timeout) sets `stop` ("gone")."""

    def __init__(self, write: Callable[[bytes], object], limit: int, stop: Stop):
        self._write, self._limit, self._stop = write, limit, stop
        self._queue: deque[bytes] = deque()
        self._size = 0
        self._closed = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="event-sender", daemon=True)
        self._thread.start()

    def put(self, data: bytes, closing: bool = False) -> None:
        with self._ready:
            if self._closed:  # the writer failed: nobody is reading
                return
            if self._stop.reason == "behind" and not closing:
                return
            if self._size + len(data) > self._limit and not closing:
                self._stop.set("behind")
                return
            self._queue.append(data)
            self._size += len(data)
            self._ready.notify()

    def close(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the buffer to go out; False if it did not."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                data = self._queue.popleft()
                self._size -= len(data)
            try:
                self._write(data)
            except OSError:
                self._stop.set("gone")
                with self._ready:
                    self._queue.clear()
                    self._closed = True
                return
