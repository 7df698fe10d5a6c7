"""A one-line progress display on stderr for long work (downloads, conversion, training)."""

from __future__ import annotations

import sys
import time


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.{1 if 0 < n < 10 and n != int(n) else 0}f}{unit and ' ' + unit}"
    for suffix in ("B", "KB", "MB", "GB"):
        if n < 1024 or suffix == "GB":
            return f"{n:.1f} {suffix}" if suffix != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GB"


class Progress:
    """`advance(n)` as work is done; `close()` when finished. Redraws at most 10 times a second,
    with rate and ETA. When stderr is not a terminal (a log), a plain line per 10% of the work,
    and at least one a minute so that a slow tenth does not look like a hang."""

    def __init__(
        self, label: str, total: float, unit: str = "", quiet: bool = False, done: float = 0.0,
        log_every_s: float = 60.0,
    ):
        """`done` is work already finished before this run (a resumed job): it counts toward the
        bar but not toward the rate."""
        self.label, self.total, self.unit, self.quiet = label, total, unit, quiet
        self.done = self._resumed = float(done)
        self.start = self._last = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1
        self.log_every_s = log_every_s
        self.extra = ""

    def advance(self, n: float = 1, extra: str = "") -> None:
        self.done += n
        self.extra = extra or self.extra
        now = time.perf_counter()
        if self.quiet:
            return
        if self.tty:
            if now - self._last >= 0.1 or self.done >= self.total:
                self._last = now
                sys.stderr.write("\r" + self.line() + "\033[K")
                sys.stderr.flush()
        else:
            decile = int(10 * self.done / self.total) if self.total else 10
            if decile > self._last_decile or now - self._last >= self.log_every_s:
                self._last_decile, self._last = decile, now
                print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        rate = (self.done - self._resumed) / elapsed if elapsed > 0 else 0.0
        eta = max(0.0, self.total - self.done) / rate if rate > 0 else float("inf")
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        eta_text = f"ETA {eta:5.0f}s" if eta != float("inf") else "ETA    ?"
        return (
            f"{self.label} [{bar}] {100 * frac:5.1f}% {_human(self.done, self.unit)}"
            f"/{_human(self.total, self.unit)} {_human(rate, self.unit)}/s {eta_text}"
            + (f" {self.extra}" if self.extra else "")
        )

    def close(self) -> None:
        if not self.quiet and self.tty:
            sys.stderr.write("\r" + self.line() + "\033[K\n")
            sys.stderr.flush()
