"""The meters' common interface: what every backend reads, what it raises where it cannot
run, and a window's energy measured around some work."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class Meter(Protocol):
    backend: str

    def read(self) -> dict[str, float]:
        """Cumulative joules per rail since the meter was opened."""

    def close(self) -> None:
        """Release the counters (idempotent)."""


class MeterUnavailable(Exception):
    """This backend cannot measure here; the message says why, for the user."""


@dataclass
class EnergyReading:
    seconds: float
    joules: dict[str, float] = field(default_factory=dict)

    @property
    def total_j(self) -> float:
        return sum(self.joules.values())

    @property
    def watts(self) -> float:
        return self.total_j / self.seconds if self.seconds > 0 else 0.0


def measure(meter: Meter, work: Callable[[], object]) -> tuple[EnergyReading, object]:
    """Energy and time spent while `work()` runs; returns the reading and what work returned."""
    before, t0 = meter.read(), time.perf_counter()
    out = work()
    after, t1 = meter.read(), time.perf_counter()
    joules = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return EnergyReading(t1 - t0, joules), out
