"""Picks the energy meter for this machine, or says why there is none."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidParameter
from ..platform import is_macos
from .meter import Meter, MeterUnavailable

BACKENDS = ("auto", "ioreport", "powermetrics", "rapl", "none")


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
