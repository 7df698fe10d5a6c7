"""Linux RAPL energy counters through powercap sysfs.

Zones are folders `intel-rapl:N` (a package; AMD CPUs use the same names) with subzones
`intel-rapl:N:M` (core, uncore, dram). Each has `name`, `energy_uj` (a counter that wraps at
`max_energy_range_uj`) and `max_energy_range_uj`. The CPU rail sums the `package-*` zones; the
DRAM rail sums the `dram` zones. `psys` (the whole platform) and core/uncore subzones overlap the
packages and are left out. Since Linux 5.10 `energy_uj` is readable by root only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .meter import MeterUnavailable

_ZONE = re.compile(r"^intel-rapl:\d+(:\d+)?$")


@dataclass
class _Zone:
    rail: str
    counter: Path
    wrap: int  # the counter's range in microjoules
    last: int
    total: int = 0  # microjoules since the meter opened

    def update(self) -> None:
        now = int(self.counter.read_text())
        # One wrap at most between reads: at 100 W a 2^38 uJ range lasts ~45 minutes.
        self.total += now - self.last if now >= self.last else now + self.wrap - self.last
        self.last = now


def _rail(name: str) -> str | None:
    if name.startswith("package"):
        return "cpu"
    if name == "dram":
        return "dram"
    return None


class RaplMeter:
    backend = "rapl"

    def __init__(self, root: Path = Path("/sys/class/powercap")):
        folders = sorted(p for p in root.glob("intel-rapl:*") if _ZONE.match(p.name)) \
            if root.is_dir() else []
        if not folders:
            raise MeterUnavailable(f"no RAPL zones under {root} (this machine exposes no CPU "
                                   "energy counters)")
        self.zones: list[_Zone] = []
        for folder in folders:
            try:
                rail = _rail((folder / "name").read_text().strip())
                if rail is None:
                    continue
                counter = folder / "energy_uj"
                self.zones.append(_Zone(rail, counter,
                                        int((folder / "max_energy_range_uj").read_text()),
                                        int(counter.read_text())))
            except (OSError, ValueError) as e:
                raise MeterUnavailable(
                    f"cannot read {folder} ({e}); energy_uj is readable by root only since "
                    "Linux 5.10") from e
        if not self.zones:
            raise MeterUnavailable(f"no package or dram RAPL zones under {root}")

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for z in self.zones:
            z.update()
            out[z.rail] = out.get(z.rail, 0.0) + z.total / 1e6
        return out

    def close(self) -> None:
        pass
