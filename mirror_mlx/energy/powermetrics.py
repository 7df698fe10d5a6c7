"""macOS energy from `powermetrics` (needs sudo without a password prompt: `sudo -n`).

The usual sudoers rule allows only powermetrics without a password, so nothing is checked
beforehand with another command (`sudo -n true` would be refused): the real command runs, and
if it gives no sample, what it said is the error.

powermetrics runs in the background and prints one property list per sample, NUL-separated
(`-f plist`); a reader thread adds each sample's energy to running totals. Each sample holds
`elapsed_ns` and, under `processor` (or `gpu` on some macOS versions), `cpu_energy`,
`gpu_energy`, `ane_energy` in millijoules over the sample, or only the `*_power` values in
milliwatts. A read is as fresh as the last sample (every 500 ms).
"""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import threading

from .meter import MeterUnavailable

INTERVAL_MS = 500
COMMAND = ["sudo", "-n", "powermetrics", "-f", "plist", "-i", str(INTERVAL_MS),
           "-s", "cpu_power,gpu_power,ane_power"]


def sample_joules(sample: dict) -> dict[str, float]:
    """Joules per rail in one parsed powermetrics sample."""
    seconds = sample.get("elapsed_ns", 0) / 1e9
    out = {}
    for rail in ("cpu", "gpu", "ane"):
        for section in (sample.get("processor") or {}, sample.get("gpu") or {}):
            if f"{rail}_energy" in section:
                out[rail] = section[f"{rail}_energy"] / 1e3
                break
            if f"{rail}_power" in section:
                out[rail] = section[f"{rail}_power"] / 1e3 * seconds
                break
    return out


def split_samples(buffer: bytes) -> tuple[list[dict], bytes]:
    """The complete samples in `buffer`, and the unfinished rest."""
    *done, rest = buffer.split(b"\x00")
    samples = []
    for chunk in done:
        chunk = chunk.strip()
        if chunk:
            samples.append(plistlib.loads(chunk))
    return samples, rest


class PowermetricsMeter:
    backend = "powermetrics"

    def __init__(self, first_sample_timeout_s: float = 5.0):
        if shutil.which("powermetrics") is None:
            raise MeterUnavailable("powermetrics is not on the PATH")
        self.totals: dict[str, float] = {}
        self._lock = threading.Lock()
        self._first = threading.Event()
        self.proc = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._thread = threading.Thread(target=self._pump, daemon=True,
                                        name="mirror-powermetrics")
        self._thread.start()
        if not self._first.wait(first_sample_timeout_s):
            self.close()
            err = self.proc.stderr.read().decode(errors="replace").strip()
            raise MeterUnavailable(
                f"`{' '.join(COMMAND)}` gave no sample in {first_sample_timeout_s:g} s"
                + (f": {err}" if err else "")
                + (" (powermetrics needs sudo without a password prompt)"
                   if "password" in err else ""))

    def _pump(self) -> None:
        buffer = b""
        while chunk := self.proc.stdout.read1(65536):
            samples, buffer = split_samples(buffer + chunk)
            with self._lock:
                for sample in samples:
                    for rail, joules in sample_joules(sample).items():
                        self.totals[rail] = self.totals.get(rail, 0.0) + joules
            if samples:
                self._first.set()

    def read(self) -> dict[str, float]:
        with self._lock:
            return dict(self.totals)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
