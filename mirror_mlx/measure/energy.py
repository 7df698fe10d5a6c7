"""Energy meters behind one interface, and the one place that picks a meter for this machine.

A meter reads cumulative joules per rail ("cpu", "gpu", "ane", "dram") since it was opened; a
window's energy is the difference of two reads. Backends:

- macOS: IOReport (no sudo; CPU, GPU, ANE, DRAM), else powermetrics (needs passwordless sudo);
- elsewhere: Linux RAPL (/sys/class/powercap), where its counters are readable;
- otherwise none, with the reason said plainly.

All of them are model-based estimates or coarse counters: measure long windows (IOReport's
millijoule channels may publish only every ~2 s), subtract an idle baseline measured the same way,
and report joules per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import InvalidParameter
from ..platform import is_macos

BACKENDS = ("auto", "ioreport", "powermetrics", "rapl", "none")


class Meter(Protocol):
    backend: str

    def read(self) -> dict[str, float]:
        """Cumulative joules per rail since the meter was opened."""

    def close(self) -> None:
        """Release the counters (idempotent)."""


class MeterUnavailable(Exception):
    """This backend cannot measure here; the message says why, for the user."""


@dataclass
class MeterChoice:
    meter: Meter | None
    backend: str  # the backend in use, or "none"
    note: str  # why this one, or why energy is unavailable

    @property
    def available(self) -> bool:
        return self.meter is not None

    def close(self) -> None:
        if self.meter is not None:
            self.meter.close()


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


def _openers(rapl_root: Path) -> dict[str, Callable[[], Meter]]:
    def ioreport():
        if not is_macos():
            raise MeterUnavailable("IOReport exists only on macOS")
        from .ioreport import IOReportMeter

        return IOReportMeter()

    def powermetrics():
        if not is_macos():
            raise MeterUnavailable("powermetrics exists only on macOS")
        from .powermetrics import PowermetricsMeter

        return PowermetricsMeter()

    def rapl():
        from .rapl import RaplMeter

        return RaplMeter(rapl_root)

    return {"ioreport": ioreport, "powermetrics": powermetrics, "rapl": rapl}


def open_meter(choice: str = "auto",
               rapl_root: Path = Path("/sys/class/powercap")) -> MeterChoice:
    """The meter for `choice` (see BACKENDS); "auto" tries this platform's backends in order.
    Never raises for a backend that cannot run here: the choice says why instead."""
    if choice not in BACKENDS:
        raise InvalidParameter(f"--energy must be one of {', '.join(BACKENDS)} (got '{choice}')")
    if choice == "none":
        return MeterChoice(None, "none", "energy not measured (--energy none)")
    order = [choice] if choice != "auto" else (
        ["ioreport", "powermetrics"] if is_macos() else ["rapl"])
    openers = _openers(rapl_root)
    why = []
    for name in order:
        try:
            meter = openers[name]()
        except MeterUnavailable as e:
            why.append(f"{name}: {e}")
            continue
        return MeterChoice(meter, name, _NOTES[name])
    return MeterChoice(None, "none", "unavailable: " + "; ".join(why))


_NOTES = {
    "ioreport": "macOS IOReport 'Energy Model' counters (model-based estimates; CPU, GPU, ANE, "
                "DRAM); the millijoule channels may publish only every ~2 s",
    "powermetrics": "macOS powermetrics via sudo (model-based estimates; CPU, GPU, ANE), "
                    "sampled every 500 ms",
    "rapl": "Linux RAPL (powercap) package and DRAM counters",
}
