"""Bounds on how long collectives may take. A transfer whose peer died or hangs blocks
inside MLX, where no Python exception can reach it: past a bound the process prints one
error and exits, which ends the other ranks too (mlx.launch stops the rest, and a stage whose
peer is gone fails its own transfer). Several bounds may be armed at once (a forward's
collectives waited for on one thread, the next transfer made on another)."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from contextlib import contextmanager


class Watchdog:
    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, str, float]] = {}
        self._tokens = itertools.count()
        self._wake = threading.Event()
        threading.Thread(target=self._watch, name="mirror-watchdog", daemon=True).start()

    def arm(self, doing: str, seconds: float) -> int:
        """A bound from now until `disarm` is given the token this returns."""
        token = next(self._tokens)
        with self._lock:
            self._armed[token] = (time.monotonic() + seconds, doing, seconds)
        self._wake.set()
        return token

    def disarm(self, token: int) -> None:
        with self._lock:
            self._armed.pop(token, None)

    @contextmanager
    def bound(self, doing: str, seconds: float | None):
        if seconds is None:
            yield
            return
        token = self.arm(doing, seconds)
        try:
            yield
        finally:
            self.disarm(token)

    def _watch(self) -> None:
        while True:
            with self._lock:
                first = min(self._armed.values(), default=None)
            if first is None:
                self._wake.wait()
                self._wake.clear()
                continue
            left = first[0] - time.monotonic()
            if left > 0:
                time.sleep(min(left, 0.5))
                continue
            with self._lock:
                if first not in self._armed.values():
                    continue
            # Rank 0 speaks for the run; a stage only says why it stopped.
            who = "mirror-mlx: error" if self.rank == 0 else f"mirror-mlx: rank {self.rank}"
            print(f"{who}: no answer within {first[2]:g} s while {first[1]} (a rank died, "
                  "hangs or cannot be reached); stopping", file=sys.stderr, flush=True)
            os._exit(1)
