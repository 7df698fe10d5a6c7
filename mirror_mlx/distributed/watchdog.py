"""A bound on how long a collective may take. A transfer whose peer died or hangs blocks
inside MLX, where no Python exception can reach it: past the bound the process prints one
error and exits, which ends the other ranks too (mlx.launch stops the rest, and a stage whose
peer is gone fails its own transfer)."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager


class Watchdog:
    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._deadline: tuple[float, str, float] | None = None
        self._wake = threading.Event()
        threading.Thread(target=self._watch, name="mirror-watchdog", daemon=True).start()

    @contextmanager
    def bound(self, doing: str, seconds: float | None):
        if seconds is None:
            yield
            return
        with self._lock:
            self._deadline = (time.monotonic() + seconds, doing, seconds)
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while True:
            with self._lock:
                armed = self._deadline
            if armed is None:
                self._wake.wait()
                self._wake.clear()
                continue
            left = armed[0] - time.monotonic()
            if left > 0:
                time.sleep(min(left, 0.5))
                continue
            with self._lock:
                if self._deadline is not armed:
                    continue
            # Rank 0 speaks for the run; a stage only says why it stopped.
            who = "mirror-mlx: error" if self.rank == 0 else f"mirror-mlx: rank {self.rank}"
            print(f"{who}: no answer within {armed[2]:g} s while {armed[1]} (a rank died, "
                  "hangs or cannot be reached); stopping", file=sys.stderr, flush=True)
            os._exit(1)
